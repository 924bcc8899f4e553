"""Handoff control messages (type ids 32-47) and their mapping to events.

Token ids travel as LEB128 varints (:func:`pddnet.wire.encode_tokens`): a
17-bit vocabulary id costs 3 bytes, any uint32 at most 5. Request ids are
integers, so the fixed part of an authenticated ``TokenBatch`` frame is about
45 bytes (16-byte tag, 14-byte envelope, id, start, bin header, flag); see
``tests/test_handoff_messages.py`` for the measured bound.

======  ==============  ==========================================
id      message         direction and meaning
======  ==============  ==========================================
32      TokenBatch      RLD -> MD: tokens ``[start, start+n)``; ``final``
                        means RLD stopped emitting at ``start+n``
33      HandoffAck      MD -> RLD: recomputed before ``position``;
                        ``owner`` once MD has taken over
34      KvReady         MD -> RLD: MD holds the prompt KV
35      HandoffAbort    either way: abandon the handoff, with a reason
36      FirstToken      P -> RLD and MD: P's first token, for
                        an offer that said it follows (``KvOffer.first_token``
                        = -1); the decoder decodes from position 0 only
                        once it has it
======  ==============  ==========================================
"""

from __future__ import annotations

from collections.abc import Sequence

from .._errors import RemoteProtocolError
from ..wire import ControlLimits, Message, decode_tokens, encode_tokens, message
from ._events import (
    AbortReason,
    BatchAcked,
    BatchReceived,
    Event,
    KvLanded,
    PeerAborted,
)

__all__ = [
    "K_MAX_TOKEN_ID",
    "FirstToken",
    "HandoffAbort",
    "HandoffAck",
    "KvReady",
    "TokenBatch",
    "check_first_token",
    "event_for_message",
    "request_id_of",
]


@message(32)
class TokenBatch(Message):
    """Token ids RLD generated at positions ``[start, start + n)``."""

    request_id: int
    start: int
    tokens: bytes
    final: bool

    @classmethod
    def build(cls, request_id: int, start: int, tokens: Sequence[int], final: bool) -> TokenBatch:
        """Encode ``tokens`` as varints into a batch message."""
        return cls(request_id, start, encode_tokens(list(tokens)), final)


@message(33)
class HandoffAck(Message):
    """MD recomputed every token before ``position``; ``recompute_rate`` in
    tokens/s (0 if unknown) lets RLD refine its convergence estimate."""

    request_id: int
    position: int
    owner: bool
    recompute_rate: int = 0


@message(34)
class KvReady(Message):
    """MD holds the prompt KV: RLD may start handing over."""

    request_id: int


@message(35)
class HandoffAbort(Message):
    """The sender abandons the handoff; ``reason`` is an :class:`AbortReason`."""

    request_id: int
    reason: int


@message(36)
class FirstToken(Message):
    """P's first token (position 0 of the user's stream), sent after a
    ``KvOffer`` whose ``first_token`` was -1: P shipped the prompt's KV
    (layer by layer) before its engine sampled. At most one per request."""

    request_id: int
    token: int


K_MAX_TOKEN_ID = 0xFFFF_FFFF  # token ids are uint32 (docs/wire.md, "Token ids")

_HANDOFF_MESSAGES = (TokenBatch, HandoffAck, KvReady, HandoffAbort, FirstToken)


def check_first_token(msg: FirstToken, *, known: bool, peer: str = "") -> None:
    """Refuse a :class:`FirstToken` for a request this node does not serve
    (``known`` False) or with a token that is not a uint32 id.

    Raises:
        RemoteProtocolError: naming the request.
    """
    if not known:
        raise RemoteProtocolError(
            "FirstToken for an unknown request", peer=peer, request_id=msg.request_id
        )
    if not 0 <= msg.token <= K_MAX_TOKEN_ID:
        raise RemoteProtocolError(
            f"FirstToken {msg.token} is not a uint32 token id",
            peer=peer,
            request_id=msg.request_id,
        )


def request_id_of(msg: Message) -> int | None:
    """The request id of a handoff message, or None for any other message."""
    if isinstance(msg, _HANDOFF_MESSAGES):
        return msg.request_id
    return None


def event_for_message(msg: Message, limits: ControlLimits | None = None) -> Event:
    """Translate a received handoff message into the machine event it means.

    Raises:
        RemoteProtocolError: if the message carries malformed tokens, a
            negative position or an unknown abort reason.
    """
    limits = limits or ControlLimits()
    rid = request_id_of(msg)
    if isinstance(msg, TokenBatch):
        if msg.start < 0:
            raise RemoteProtocolError("negative batch start", request_id=rid)
        toks = decode_tokens(msg.tokens, limits.max_tokens)
        return BatchReceived(msg.start, tuple(int(t) for t in toks), msg.final)
    if isinstance(msg, HandoffAck):
        if msg.position < 0 or msg.recompute_rate < 0:
            raise RemoteProtocolError("negative ack field", request_id=rid)
        rate = float(msg.recompute_rate) if msg.recompute_rate > 0 else None
        return BatchAcked(msg.position, msg.owner, rate)
    if isinstance(msg, KvReady):
        return KvLanded()
    if isinstance(msg, HandoffAbort):
        try:
            reason = AbortReason(msg.reason)
        except ValueError:
            raise RemoteProtocolError(
                f"unknown abort reason {msg.reason}", request_id=rid
            ) from None
        return PeerAborted(reason)
    raise RemoteProtocolError(f"{type(msg).__name__} is not a handoff message")
