"""Handoff parameters: modes, thresholds, estimates and deadlines."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Fallback", "HandoffMode", "HandoffParams"]


class HandoffMode(enum.Enum):
    """How RLD hands the request to MD once MD holds the KV."""

    ONE_SHOT = "one-shot"  # every eager token in one final batch
    CATCH_UP = "catch-up"  # shrinking rounds while RLD keeps decoding, then the final switch


class Fallback(enum.Enum):
    """What RLD does when catch-up does not converge."""

    ONE_SHOT = "one-shot"  # hand everything over now and accept one stall
    KEEP_RLD = "keep-rld"  # abandon the handoff; RLD decodes to completion
    AUTO = "auto"  # one-shot if the predicted stall is under max_stall_s, else keep RLD


@dataclass(frozen=True, slots=True)
class HandoffParams:
    """Tuning of one handoff (docs/handoff.md, "Parameters", says how to choose).

    Args:
        mode: one-shot or catch-up.
        catchup_threshold: with catch-up, hand over in one shot anyway when at
            most this many tokens are pending once MD's KV lands (source: 64).
        final_switch_size: the final switch happens once at most this many
            tokens are unsent; it bounds the user-visible stall.
        min_batch: a non-final batch never carries fewer tokens; smaller
            remainders wait for more tokens (merged) or ride in the final switch.
        max_rounds: most batches per request, final switch included.
        recompute_rate: MD's extend speed estimate in tokens/s, refined by the
            rates MD reports in its acks.
        rtt_s: control-plane round trip estimate between RLD and MD.
        fallback: what to do when catch-up cannot converge.
        max_stall_s: with ``Fallback.AUTO``, the largest predicted one-shot stall
            accepted instead of keeping RLD.
        min_shrink: a round must shrink the pending tokens to at most this
            fraction of the previous batch, or catch-up is declared divergent.
        kv_timeout_s: how long either side waits for MD's KV to land.
        ack_timeout_s: base wait for an ack before retransmitting a batch; the
            batch's predicted recompute time is added to it.
        max_retries: retransmissions of one batch before giving up.
        idle_timeout_s: how long MD waits for RLD's next batch before it
            presumes RLD dead and frees its blocks.
        recompute_timeout_s: base deadline of one extend pass on MD (plus its
            predicted duration).
        max_message_tokens: most token ids per ``TokenBatch`` message; larger
            batches are split (the receiver's ``ControlLimits.max_tokens`` is 8192).
        playout_s: RLD's playout buffer (0: off). While MD may yet take over,
            RLD shows each token it decodes up to this long after decoding it
            (the delay ramps up by half a decode interval per token, so no gap
            grows by more than that); when it sends the final batch, it spreads
            the tokens it still holds evenly up to MD's predicted first token
            (``rtt_s`` plus one decode interval after the batch), so the switch
            stall becomes several smaller gaps. What it costs: RLD's tokens
            reach the user up to ``playout_s`` later, and the spread may move a
            held token later still, never past MD's predicted first token
            (``RelayStats.playout_*`` count it); P's first token, the last
            token of a request RLD finishes (it flushes what is held) and MD's
            tokens are not delayed. docs/handoff.md, "Playout", says what else
            it trades.
    """

    mode: HandoffMode = HandoffMode.CATCH_UP
    catchup_threshold: int = 64
    final_switch_size: int = 16
    min_batch: int = 16
    max_rounds: int = 4
    recompute_rate: float = 2000.0
    rtt_s: float = 0.05
    fallback: Fallback = Fallback.AUTO
    max_stall_s: float = 1.0
    min_shrink: float = 0.9
    kv_timeout_s: float = 30.0
    ack_timeout_s: float = 1.0
    max_retries: int = 3
    idle_timeout_s: float = 10.0
    recompute_timeout_s: float = 5.0
    max_message_tokens: int = 4096
    playout_s: float = 0.0

    def __post_init__(self) -> None:
        if self.final_switch_size < 0 or self.min_batch < 1:
            raise ValueError("final_switch_size must be >= 0 and min_batch >= 1")
        if self.catchup_threshold < max(self.final_switch_size, self.min_batch):
            raise ValueError("catchup_threshold must be >= final_switch_size and min_batch")
        if self.max_rounds < 1 or self.max_retries < 0:
            raise ValueError("max_rounds must be >= 1 and max_retries >= 0")
        if self.recompute_rate <= 0 or self.rtt_s < 0:
            raise ValueError("recompute_rate must be > 0 and rtt_s >= 0")
        if self.playout_s < 0:
            raise ValueError("playout_s must be >= 0")
        if self.max_message_tokens < 1:
            raise ValueError("max_message_tokens must be >= 1")
        if not 0 < self.min_shrink <= 1:
            raise ValueError("min_shrink must lie in (0, 1]")
        for name in ("kv_timeout_s", "ack_timeout_s", "idle_timeout_s", "recompute_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
