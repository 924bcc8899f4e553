"""Events (inputs) and outputs of the handoff machines.

Events are what happens *to* a machine: the engine generated a token, a
message arrived, a timer fired. Outputs are what the machine asks its driver
to do: emit a token to the user, send a message, cancel a transfer. Both are
frozen, slotted dataclasses with no behaviour. Time is never read by a
machine; the driver passes ``now`` with every event.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .._errors import PddnetError
from ..wire import Message

__all__ = [
    "AbortReason",
    "BatchAcked",
    "BatchReceived",
    "Cancel",
    "CancelTransfer",
    "Done",
    "Emit",
    "Event",
    "FinishReason",
    "FreeBlocks",
    "KvLanded",
    "Output",
    "PeerAborted",
    "PeerFailed",
    "RecomputeDone",
    "RequestFinished",
    "SendMessage",
    "StartRecompute",
    "TakeOver",
    "Timer",
    "TokenGenerated",
]


class FinishReason(enum.IntEnum):
    """Why a request ended normally."""

    EOS = 1
    MAX_TOKENS = 2
    STOP = 3


class AbortReason(enum.IntEnum):
    """Why one side abandons the handoff (carried by ``HandoffAbort``)."""

    RLD_FINISHED = 1  # strange traffic: RLD finished the whole answer first
    CANCELLED = 2  # the user cancelled the request
    FALLBACK = 3  # catch-up did not converge; RLD keeps the request to completion
    TIMEOUT = 4  # a deadline passed (KV never landed, acks never came)
    MD_FAILED = 5  # MD cannot take over (recompute failed or hung)
    RLD_FAILED = 6  # MD saw RLD die and cannot continue


# --------------------------------------------------------------------- events
class Event:
    """Base of every input event."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class TokenGenerated(Event):
    """The local engine produced the next token.

    ``finish`` is set when this token ends the request (EOS, max_tokens or a
    stop condition); the engine knows that when it samples the token, and
    passing it here keeps "last token" and "switch" decisions atomic.
    """

    token: int
    finish: FinishReason | None = None


@dataclass(frozen=True, slots=True)
class RequestFinished(Event):
    """The request ended without a new token (e.g. a stop string matched)."""

    reason: FinishReason


@dataclass(frozen=True, slots=True)
class KvLanded(Event):
    """MD holds the prompt KV (on MD: the WAN transfer completed; on RLD:
    MD's ``KvReady`` message arrived)."""


@dataclass(frozen=True, slots=True)
class BatchReceived(Event):
    """MD received a token batch covering positions ``[start, start+len)``."""

    start: int
    tokens: tuple[int, ...]
    final: bool


@dataclass(frozen=True, slots=True)
class BatchAcked(Event):
    """RLD received MD's ack: MD recomputed every token before ``position``.

    ``owner`` is true once MD has taken the request over. ``recompute_rate``
    is MD's measured recompute speed in tokens/s, if it reported one.
    """

    position: int
    owner: bool
    recompute_rate: float | None = None


@dataclass(frozen=True, slots=True)
class RecomputeDone(Event):
    """MD's engine finished the extend pass; KV is valid before ``position``."""

    position: int


@dataclass(frozen=True, slots=True)
class Timer(Event):
    """The driver's timer fired (it slept until ``machine.get_timer()``)."""


@dataclass(frozen=True, slots=True)
class PeerFailed(Event):
    """The failure detector declared the peer dead.

    ``user_position`` is how many tokens the user's stream holds, if the
    caller knows it (the stream's sink does); it decides whether the
    survivor may continue without duplicating or skipping a token.

    ``user_tokens``, if given, are the user's tokens at positions
    ``0..user_position-1`` (the sink has them): MD may take them as RLD's
    final batch when they agree with what it holds, so it can take over even
    if RLD died before sending it everything.

    ``takeover_only`` marks a report that is a suspicion rather than the
    failure detector's verdict (the sink lost RLD and MD's own ping to it
    failed): MD acts on it only if it can take over exactly at
    ``user_position``, and otherwise ignores it and keeps waiting, so that
    the failure detector still decides every other outcome. RLD never gets
    one.
    """

    user_position: int | None = None
    user_tokens: tuple[int, ...] | None = None
    takeover_only: bool = False


@dataclass(frozen=True, slots=True)
class PeerAborted(Event):
    """The peer abandoned the handoff (a ``HandoffAbort`` arrived)."""

    reason: AbortReason


@dataclass(frozen=True, slots=True)
class Cancel(Event):
    """The user (or the operator) cancelled the request."""


# -------------------------------------------------------------------- outputs
class Output:
    """Base of every output."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Emit(Output):
    """Deliver ``token`` at ``position`` of the user's stream."""

    position: int
    token: int


@dataclass(frozen=True, slots=True)
class SendMessage(Output):
    """Send ``message`` to the peer machine of this request."""

    message: Message


@dataclass(frozen=True, slots=True)
class CancelTransfer(Output):
    """Cancel the P->MD WAN transfer of this request's KV."""

    reason: AbortReason


@dataclass(frozen=True, slots=True)
class FreeBlocks(Output):
    """MD: free the KV blocks reserved for this request (it will not own it)."""


@dataclass(frozen=True, slots=True)
class StartRecompute(Output):
    """MD: run one extend pass over ``tokens`` at positions ``[start, ...)``,
    then feed :class:`RecomputeDone` back."""

    start: int
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TakeOver(Output):
    """MD: you own the request; decode and emit from ``position`` on."""

    position: int


@dataclass(frozen=True, slots=True)
class Done(Output):
    """The machine reached a terminal state; ``error`` is set if it failed."""

    state: enum.Enum
    error: PddnetError | None = None
