"""Control messages of the engine-facing API (type ids 64-79)."""

from __future__ import annotations

from .._errors import RemoteProtocolError
from ..handoff._messages import K_MAX_TOKEN_ID
from ..wire import Message, message

__all__ = [
    "Abort",
    "CutOffWan",
    "Emitted",
    "K_FIRST_TOKEN_FOLLOWS",
    "KvAccept",
    "KvOffer",
    "LeaseRenew",
    "Lookup",
    "LookupReply",
    "Register",
    "StatsReply",
    "StatsRequest",
    "StreamAck",
    "StreamResend",
    "StreamStatus",
    "StreamTakeover",
]


#: ``KvOffer.first_token`` when P's first token follows in a ``FirstToken``.
K_FIRST_TOKEN_FOLLOWS = -1


@message(64)
class KvOffer(Message):
    """P to a decode node: take this request's prompt KV.

    ``prompt`` is the prompt's token ids (varints); ``first_token`` is the
    token P's prefill produced (position 0 of the user's stream), or
    :data:`K_FIRST_TOKEN_FOLLOWS` (-1) when P ships the KV before sampling and
    sends it later in a :class:`~pddnet.handoff.FirstToken`. ``relay``
    and ``main`` name the request's RLD and MD ("" when the route has none),
    and ``sink`` the node that receives the user's token stream.
    ``deadline_s`` (seconds from now, 0 = none) caps every wait the decoder
    makes for this request: the KV landing, and batches from the other side.
    """

    request_id: int
    prompt: bytes
    first_token: int
    max_tokens: int
    relay: str
    main: str
    sink: str
    deadline_s: float = 0.0

    def offered_first_token(self) -> int | None:
        """``first_token``, or None when a :class:`~pddnet.handoff.FirstToken` follows.

        Raises:
            RemoteProtocolError: for any other value outside uint32.
        """
        if self.first_token == K_FIRST_TOKEN_FOLLOWS:
            return None
        if not 0 <= self.first_token <= K_MAX_TOKEN_ID:
            raise RemoteProtocolError(
                f"bad first_token {self.first_token}", request_id=self.request_id
            )
        return self.first_token


@message(65)
class KvAccept(Message):
    """A decode node's answer to :class:`KvOffer`: where to send which blocks.

    The receiver already holds the first ``skip_blocks`` blocks of the prompt
    (its radix cache); P sends blocks ``skip_blocks..`` into the grant.
    """

    request_id: int
    transfer_id: int
    total: int
    layer_ends: list[int]
    address: str
    skip_blocks: int
    lease_s: float


@message(66)
class Emitted(Message):
    """A decode node to the sink: the user's token at ``position``."""

    request_id: int
    position: int
    token: int
    source: str
    finished: bool


@message(67)
class LeaseRenew(Message):
    """A receiver to P: keep the request's source blocks; the transfer is alive."""

    request_id: int


@message(68)
class Abort(Message):
    """Any node: stop working on the request; ``reason`` is for humans."""

    request_id: int
    reason: str


@message(69)
class CutOffWan(Message):
    """RLD to P: the request ended before MD's KV landed; stop its WAN transfer
    (the strange-traffic cut-off). ``reason`` names the handoff's reason."""

    request_id: int
    reason: str


@message(71)
class Register(Message):
    """Rendezvous: publish an endpoint's handshake blob under (engine id, rank)."""

    engine_id: str
    rank: int
    blob: bytes


@message(72)
class Lookup(Message):
    """Rendezvous: ask for the blob registered under (engine id, rank)."""

    engine_id: str
    rank: int


@message(73)
class LookupReply(Message):
    blob: bytes


@message(74)
class StatsRequest(Message):
    """Ask an endpoint for its counters and recent per-request handoff metrics."""


@message(75)
class StatsReply(Message):
    """``payload`` is a msgpack map: ``{"statistics": {...}, "requests": [...]}``."""

    payload: bytes


@message(76)
class StreamResend(Message):
    """The sink to a decoder: re-send your tokens of the request at positions
    ``start..`` (every one you hold from there), then answer with
    :class:`StreamStatus`."""

    request_id: int
    start: int


@message(77)
class StreamStatus(Message):
    """A decoder's answer to :class:`StreamResend`.

    ``state`` is a :class:`~pddnet.api.SourceState` value; ``first``/``last``
    are the first and last positions it emitted (-1: none); ``detail`` is why
    it failed, for humans.
    """

    request_id: int
    state: int
    first: int
    last: int
    detail: str = ""


@message(78)
class StreamAck(Message):
    """The sink to a decoder: the whole stream arrived; forget its tokens."""

    request_id: int


@message(79)
class StreamTakeover(Message):
    """The sink to MD (a request, answered with :class:`StreamStatus`): RLD
    stopped answering the sink's rounds while MD still serves the request;
    the user's stream holds ``position`` tokens, ``tokens`` (varints: the
    ids at positions ``0..position-1``).

    MD confirms that RLD is unreachable from it too (one ping) and then takes
    over at ``position`` if its handoff machine can do so exactly there (see
    :class:`~pddnet.handoff.PeerFailed`, ``takeover_only``); otherwise it
    ignores the report. MD honours it only from the request's sink.
    """

    request_id: int
    position: int
    tokens: bytes
