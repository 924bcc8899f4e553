"""DRC control messages (type ids 48-55; 56-63 are left to the dual path).

Events flow MD -> P, one way and in order; the plan handshake is a request
and its reply. See docs/drc.md for the protocol.
"""

from __future__ import annotations

from ..wire import Message, message

__all__ = [
    "DrcEvicted",
    "DrcInserted",
    "DrcPlanAbort",
    "DrcPlanReply",
    "DrcPlanRequest",
    "DrcSnapshot",
    "DrcSnapshotRequest",
]


@message(48)
class DrcInserted(Message):
    """MD cached the blocks with these chain keys (event ``seq`` of ``epoch``)."""

    epoch: int
    seq: int
    keys: list[int]


@message(49)
class DrcEvicted(Message):
    """MD evicted the blocks with these chain keys (event ``seq`` of ``epoch``)."""

    epoch: int
    seq: int
    keys: list[int]


@message(50)
class DrcSnapshotRequest(Message):
    """P asks for the full key set (its mirror saw a gap, or it just connected)."""

    epoch: int


@message(51)
class DrcSnapshot(Message):
    """One part of MD's key set as of event ``seq``; the last part has ``final``."""

    epoch: int
    seq: int
    part: int
    final: bool
    block_size: int
    algo: str
    keys: list[int]


@message(52)
class DrcPlanRequest(Message):
    """P asks MD which prefix of a prompt it holds, and to pin it.

    ``tokens`` is the prompt (LEB128, :func:`pddnet.wire.encode_tokens`); MD
    verifies cached blocks against it. ``predicted_blocks`` is what P's
    mirror expects MD to hold (for accounting only).
    """

    request_id: str
    tokens: bytes
    num_tokens: int
    block_size: int
    predicted_blocks: int


@message(53)
class DrcPlanReply(Message):
    """MD holds and has pinned the first ``hit_blocks`` blocks: P sends the rest.

    ``plan_id`` names the pin; MD releases it when the transfer completes, on
    :class:`DrcPlanAbort`, or when the plan's lease expires.
    """

    request_id: str
    plan_id: int
    hit_blocks: int
    full_blocks: int
    epoch: int
    seq: int


@message(54)
class DrcPlanAbort(Message):
    """P gives up on a plan (cancelled request); MD unpins it."""

    plan_id: int
