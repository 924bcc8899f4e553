"""Session tags for an authenticated UCX sender (sans-IO helpers).

The handshake itself is :class:`pddnet.wire.AuthHandshake` (the same
challenge-response as the WAN streams), its 40-byte frames carried in UCX
control messages. Once both proofs verify, each end derives from the shared
secret and the two nonces a *session*: the tags everything else of this sender
uses. UCX's tag matching cannot tell senders apart (a posted receive matches
any endpoint's message with its tag), so the tags are what keeps a stranger
out: they are unguessable without the secret (an off-path peer would have to
hit a 56-bit mask for data, 60 bits for control), and the receiver posts
receives into granted memory only under an authenticated session's tags.

Tag spaces (the top nibble)::

    0x8  data: 0x8 << 60 | ((transfer_id << 24 | piece) ^ mask)   mask < 2**56
    0xC  the receiver's public inbox (HELLO, AUTH frames; everything when no secret)
    0xD  a sender's public inbox: 0xD << 60 | sender_id (AUTH frames, no-secret traffic)
    0xE  a session's inbox on the receiver (START, CANCEL), 60 derived bits
    0xF  a session's inbox on the sender (ACCEPT, DONE, CANCEL), 60 derived bits

Without a secret the session is the legacy one: mask 0 and the public inboxes.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from ..._errors import AuthError
from ...wire._auth import K_AUTH_FRAME_SIZE, AuthFrame, AuthKind, auth_context

__all__ = ["SessionTags", "challenge_nonce", "session_tags", "ucx_auth_context"]

K_TAG_DATA = 0x8 << 60
K_TAG_CTRL_RX = 0xC << 60
K_TAG_CTRL_TX = 0xD << 60
K_TAG_SESSION_RX = 0xE << 60
K_TAG_SESSION_TX = 0xF << 60
K_MASK_BITS = 56  # transfer id (32) + piece (24)
_LOW60 = (1 << 60) - 1
_LABEL = b"pddnet-ucx-session/1\0"


@dataclass(frozen=True, slots=True)
class SessionTags:
    """The tags of one sender's session with one receiver."""

    mask: int  # XORed into the low 56 bits of every data tag
    rx_tag: int  # the receiver's inbox for this sender
    tx_tag: int  # the sender's inbox for this receiver

    def data_tag(self, transfer_id: int, piece: int) -> int:
        return K_TAG_DATA | (((transfer_id & 0xFFFFFFFF) << 24 | piece) ^ self.mask)


def legacy_tags(sender_id: int) -> SessionTags:
    """The session of a sender when no secret is configured (public inboxes, no mask)."""
    return SessionTags(0, K_TAG_CTRL_RX, K_TAG_CTRL_TX | sender_id)


def ucx_auth_context(sender_id: int) -> bytes:
    """The handshake context: the local channel and the sender's id."""
    return auth_context("local", f"ucx-sender-{sender_id:08x}", "ucx-receiver")


def challenge_nonce(frame: bytes) -> bytes:
    """The nonce of a CHALLENGE frame.

    Raises:
        AuthError: if ``frame`` is not a CHALLENGE.
    """
    f = AuthFrame.decode(frame[:K_AUTH_FRAME_SIZE])
    if f.kind is not AuthKind.CHALLENGE:
        raise AuthError(f"expected an auth CHALLENGE, got {f.kind.name}")
    return f.payload


def session_tags(secret: bytes, n_i: bytes, n_r: bytes, sender_id: int) -> SessionTags:
    """Derive a session's tags after a successful handshake.

    Args:
        secret: the shared secret.
        n_i: the initiator's (sender's) nonce.
        n_r: the responder's (receiver's) nonce.
        sender_id: the sender's 32-bit id.

    Returns:
        Tags no one without the secret can predict; fresh per connection.
    """
    d = hmac.new(
        secret,
        _LABEL + n_i + n_r + sender_id.to_bytes(4, "little") + ucx_auth_context(sender_id),
        hashlib.sha256,
    ).digest()
    mask = int.from_bytes(d[0:8], "little") & ((1 << K_MASK_BITS) - 1)
    rx = K_TAG_SESSION_RX | int.from_bytes(d[8:16], "little") & _LOW60
    tx = K_TAG_SESSION_TX | int.from_bytes(d[16:24], "little") & _LOW60
    return SessionTags(mask, rx, tx)
