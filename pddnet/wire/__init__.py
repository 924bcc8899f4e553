"""Byte formats: the data-plane chunk header, control messages, token ids.

All decoders are sans-IO and raise :class:`~pddnet.RemoteProtocolError` (or
:class:`~pddnet.AuthError` for authentication) on any bad input.
"""

from ._auth import (
    K_AUTH_FRAME_SIZE,
    K_AUTH_MAGIC,
    K_AUTH_MAX_CONTEXT,
    K_AUTH_NONCE_SIZE,
    AuthFrame,
    AuthHandshake,
    AuthKind,
    AuthRole,
    AuthState,
    auth_context,
)
from ._chunk import (
    K_CHUNK_FLAG_TRAILER,
    K_CHUNK_HEADER_SIZE,
    K_CHUNK_MAGIC,
    K_CHUNK_TRAILER_SIZE,
    K_CHUNK_VERSION,
    K_MAX_CHUNK_LENGTH,
    ChecksumAlgo,
    ChunkHeader,
    ChunkKind,
    checksum,
)
from ._control import (
    K_CONTROL_VERSION,
    K_TAG_SIZE,
    ControlLimits,
    Frame,
    FrameKind,
    Message,
    SeqClock,
    decode_frame,
    encode_frame,
    message,
    registered_messages,
)
from ._messages import ErrorReply, Hello, Ping, Pong
from ._tokens import K_MAX_TOKEN_ID, decode_tokens, encode_tokens

__all__ = [
    "K_AUTH_FRAME_SIZE",
    "K_AUTH_MAGIC",
    "K_AUTH_MAX_CONTEXT",
    "K_AUTH_NONCE_SIZE",
    "AuthFrame",
    "AuthHandshake",
    "AuthKind",
    "AuthRole",
    "AuthState",
    "auth_context",
    "K_CHUNK_FLAG_TRAILER",
    "K_CHUNK_HEADER_SIZE",
    "K_CHUNK_MAGIC",
    "K_CHUNK_TRAILER_SIZE",
    "K_CHUNK_VERSION",
    "K_CONTROL_VERSION",
    "K_MAX_CHUNK_LENGTH",
    "K_MAX_TOKEN_ID",
    "K_TAG_SIZE",
    "ChecksumAlgo",
    "ChunkHeader",
    "ChunkKind",
    "ControlLimits",
    "ErrorReply",
    "Frame",
    "FrameKind",
    "Hello",
    "Message",
    "Ping",
    "Pong",
    "SeqClock",
    "checksum",
    "decode_frame",
    "decode_tokens",
    "encode_frame",
    "encode_tokens",
    "message",
    "registered_messages",
]
