"""The RLD side of the handoff (see ``_state.py`` for the theory of operation)."""

from __future__ import annotations

import collections
import enum
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from .._errors import PeerUnavailable, RemoteProtocolError, TransferTimeout
from ._events import (
    AbortReason,
    BatchAcked,
    Cancel,
    CancelTransfer,
    Emit,
    Event,
    KvLanded,
    PeerAborted,
    PeerFailed,
    RequestFinished,
    SendMessage,
    Timer,
    TokenGenerated,
)
from ._machine import HandoffMachine
from ._messages import HandoffAbort, TokenBatch
from ._params import Fallback, HandoffMode, HandoffParams
from ._state import RELAY_TABLE, RelayState

__all__ = ["RelayHandoff", "RelayStats"]

R = RelayState
_EMITTING = (R.DECODING, R.CATCHING_UP, R.SOLO)
_HOLDING = (R.DECODING, R.CATCHING_UP, R.SWITCHING)  # playout: MD may yet take over
_DROP_HELD = (R.CANCELLED, R.ERROR)  # held tokens nobody should see any more
_EWMA = 0.25  # weight of the newest sample in rate estimates
# Playout: the delay grows by at most this fraction of the decode interval per
# token, so a ramping gap is at most 1.5 intervals (the demo's cadence jitter
# alone reaches that: its baseline's largest gap is 24-33 ms at 20 ms steps).
K_PLAYOUT_RAMP = 0.5


class _Held(NamedTuple):
    """A token RLD decoded but shows later (playout)."""

    position: int
    token: int
    decoded_at: float
    show_at: float


@dataclass(frozen=True, slots=True)
class RelayStats:
    """A snapshot of one request on RLD.

    Attributes:
        state: the machine's state.
        tokens: tokens RLD emitted to the user.
        rounds: batches sent (final switch included; retransmissions not).
        retransmits: batches sent again after an ack timeout.
        handoff: "one-shot", "catch-up", or None if no batch was sent.
        fallback: why catch-up was abandoned, or None.
        occupancy_s: from start to release or finish (to ``now`` if running).
        max_gap_s: the largest gap between two of RLD's emits.
        first_emit_at, last_emit_at: times of RLD's first and last emits.
        final_position: where RLD stopped emitting, once the final batch is out.
        playout_tokens: tokens shown later than decoded (``playout_s``).
        playout_total_s, playout_max_s: the sum and the largest of those
            delays (decode to emit), the playout buffer's cost.
    """

    request_id: int
    state: RelayState
    tokens: int
    rounds: int
    retransmits: int
    handoff: str | None
    fallback: str | None
    occupancy_s: float
    max_gap_s: float
    first_emit_at: float | None
    last_emit_at: float | None
    final_position: int | None
    playout_tokens: int = 0
    playout_total_s: float = 0.0
    playout_max_s: float = 0.0


class RelayHandoff(HandoffMachine):
    """Sans-IO handoff machine of the RLD side of one request.

    RLD emits the tokens its engine generates, learns that MD's KV landed,
    and hands the request over in one shot or in catch-up rounds.

    Args:
        request_id: the request's id (an unsigned 64-bit integer).
        params: handoff tuning.
        now: the time the request started on RLD.
    """

    TABLE = RELAY_TABLE
    ERROR = R.ERROR
    HANDLERS: ClassVar[dict[type[Event], str]] = {
        TokenGenerated: "_on_token",
        RequestFinished: "_on_finished",
        KvLanded: "_on_kv_landed",
        BatchAcked: "_on_ack",
        PeerAborted: "_on_peer_aborted",
        PeerFailed: "_on_peer_failed",
        Timer: "_on_timer",
        Cancel: "_on_cancel",
    }

    def __init__(self, request_id: int, params: HandoffParams | None = None, *, now: float) -> None:
        super().__init__(request_id, R.DECODING, now)
        self.params = params or HandoffParams()
        self.tokens: list[int] = []
        self.acked = 0
        self.sent_end = 0
        self.final_end: int | None = None
        self.rounds = 0
        self.retransmits = 0
        self.handoff: str | None = None
        self.fallback: str | None = None
        self.batch_sizes: list[int] = []  # new tokens per batch, in order (final included)
        self.recompute_rate = self.params.recompute_rate
        self._last_batch = 0
        self._retries = 0
        self._grace = False
        self._kv_deadline: float | None = now + self.params.kv_timeout_s
        self._ack_deadline: float | None = None
        self._abort_sent: AbortReason | None = None
        self._last_token_at: float | None = None
        self._interval: float | None = None
        self._held: collections.deque[_Held] = collections.deque()  # playout, in order
        self._lag = 0.0  # the playout delay of the latest held token
        self.playout_tokens = 0
        self.playout_total_s = 0.0
        self.playout_max_s = 0.0

    # ------------------------------------------------------------ public API
    @property
    def state(self) -> RelayState:
        """The current :class:`RelayState`."""
        assert isinstance(self._state, RelayState)
        return self._state

    @property
    def may_decode(self) -> bool:
        """Whether the engine may run the next decode step for this request."""
        return self._state in _EMITTING

    @property
    def holding(self) -> int:
        """Tokens decoded but not shown yet (the playout buffer, ``playout_s``)."""
        return len(self._held)

    @property
    def decode_rate(self) -> float | None:
        """RLD's measured decode speed in tokens/s (None before two tokens)."""
        if self._interval is None or self._interval <= 0:
            return None
        return 1.0 / self._interval

    def get_timer(self) -> float | None:
        """The next deadline at which the driver must feed :class:`Timer`, or None."""
        deadline = None
        if self._state is R.DECODING:
            deadline = self._kv_deadline
        elif self._state in (R.CATCHING_UP, R.SWITCHING):
            deadline = self._ack_deadline
        if self._held:
            show = self._held[0].show_at
            deadline = show if deadline is None else min(deadline, show)
        return deadline

    def statistics(self, now: float) -> RelayStats:
        """A frozen snapshot of this request's RLD-side metrics."""
        end = self.ended_at if self.ended_at is not None else now
        return RelayStats(
            self.request_id,
            self.state,
            self.emitted,
            self.rounds,
            self.retransmits,
            self.handoff,
            self.fallback,
            end - self.started_at,
            self.max_gap_s,
            self.first_emit_at,
            self.last_emit_at,
            self.final_end,
            self.playout_tokens,
            self.playout_total_s,
            self.playout_max_s,
        )

    # --------------------------------------------------------------- helpers
    def _emit(self, token: int, now: float, *, last: bool = False) -> None:
        """The engine decoded ``token`` at ``now``: show it now, or hold it
        (playout) until its time; ``last`` (the request's last token) shows
        everything now."""
        if self._last_token_at is not None:
            dt = now - self._last_token_at
            old = self._interval
            self._interval = dt if old is None else (1 - _EWMA) * old + _EWMA * dt
        self._last_token_at = now
        position = len(self.tokens)
        self.tokens.append(token)
        show = now if last else self._playout_time(position, now)
        if show > now:
            self._held.append(_Held(position, token, now, show))
            return
        self._show_held(math.inf, now)  # what it held goes first, in order
        self._show(position, token, now, now)

    def _playout_time(self, position: int, now: float) -> float:
        """When to show the token decoded at ``now`` (``now``: at once)."""
        p = self.params
        if not p.playout_s or position == 0 or self._state not in _HOLDING:
            return now  # off, P's first token (TTFT), or no switch to come
        if self._interval is None:
            return now
        self._lag = min(p.playout_s, self._lag + K_PLAYOUT_RAMP * self._interval)
        after = self._held[-1].show_at if self._held else now
        return max(now + self._lag, after)

    def _show(self, position: int, token: int, decoded_at: float, now: float) -> None:
        self._out.append(Emit(position, token))
        self._note_emit(now)
        delay = now - decoded_at
        if delay > 0:
            self.playout_tokens += 1
            self.playout_total_s += delay
            self.playout_max_s = max(self.playout_max_s, delay)

    def _show_held(self, until: float, now: float) -> bool:
        """Show the held tokens due by ``until`` (in order); True if any."""
        shown = False
        while self._held and self._held[0].show_at <= until:
            h = self._held.popleft()
            self._show(h.position, h.token, h.decoded_at, now)
            shown = True
        return shown

    def _spread_held(self, now: float) -> None:
        """The final batch is out: spread the held tokens evenly between the
        last token shown and MD's predicted first one (``rtt_s`` plus one
        decode interval from now): each gap is the same, and the last held
        token goes out one gap before MD's."""
        if not self._held:
            return
        since = self.last_emit_at if self.last_emit_at is not None else now
        md_first = now + self.params.rtt_s + (self._interval or 0.0)
        step = (md_first - since) / (len(self._held) + 1)
        self._held = collections.deque(
            h._replace(show_at=since + k * step) for k, h in enumerate(self._held, 1)
        )

    def _set_state(self, new: enum.Enum, label: str, now: float) -> None:
        # Leaving the states in which MD may yet take over: the held tokens go
        # out now (before a Done), or nowhere if the request is given up.
        if self._held and new not in _HOLDING:
            if new in _DROP_HELD:
                self._held.clear()
            else:
                self._show_held(math.inf, now)
        super()._set_state(new, label, now)

    def _send(self, message: TokenBatch | HandoffAbort) -> None:
        self._out.append(SendMessage(message))

    def _abort(self, reason: AbortReason) -> None:
        self._abort_sent = reason
        self._send(HandoffAbort(self.request_id, int(reason)))

    def _send_tokens(self, start: int, end: int, final: bool) -> None:
        """One logical batch as one or more messages of at most
        ``max_message_tokens`` (the receiver's decode limit); only the last
        carries ``final``."""
        step = self.params.max_message_tokens
        lo = start
        while True:
            hi = min(end, lo + step)
            last = hi == end
            self._send(TokenBatch.build(self.request_id, lo, self.tokens[lo:hi], final and last))
            if last:
                return
            lo = hi

    def _send_batch(self, now: float, *, final: bool) -> None:
        start, end = self.sent_end, len(self.tokens)
        self._send_tokens(start, end, final)
        self.sent_end = end
        self.rounds += 1
        self.batch_sizes.append(end - start)
        if final:
            self.final_end = end
            self._spread_held(now)
        else:
            self._last_batch = end - start
        self._retries = 0
        self._arm_ack(now)

    def _arm_ack(self, now: float) -> None:
        p = self.params
        inflight = self.sent_end - self.acked
        self._ack_deadline = now + p.ack_timeout_s + p.rtt_s + inflight / self.recompute_rate

    def _retransmit(self, now: float) -> None:
        self._send_tokens(self.acked, self.sent_end, self.final_end is not None)
        self.retransmits += 1
        self._retries += 1
        self._arm_ack(now)

    def _divergence(self, pending: int) -> str | None:
        """Predict from the rate estimates whether catch-up reaches the final
        switch within the rounds left, sending ``pending`` now; None if it
        does, else why not."""
        d = self.decode_rate
        if d is None:
            return None
        p, r = self.params, self.recompute_rate
        if d >= r:
            return "recompute slower than decode"
        b = float(pending)
        for _ in range(p.max_rounds - self.rounds - 1):
            b = d * (b / r + p.rtt_s)  # tokens decoded while MD recomputes b
            if b <= p.final_switch_size:
                return None
        return "predicted rounds exceed max_rounds"

    def _fall_back(self, now: float, why: str) -> str:
        self.fallback = why
        p = self.params
        choice = p.fallback
        if choice is Fallback.AUTO:
            pending = len(self.tokens) - self.sent_end
            stall = pending / self.recompute_rate + p.rtt_s
            choice = Fallback.ONE_SHOT if stall <= p.max_stall_s else Fallback.KEEP_RLD
        if choice is Fallback.ONE_SHOT:
            self._send_batch(now, final=True)
            return "fallback one-shot"
        self._abort(AbortReason.FALLBACK)
        self._ack_deadline = None
        return "fallback keep"

    def _plan(self, now: float) -> str:
        """Nothing is in flight: decide the next catch-up step."""
        p = self.params
        pending = len(self.tokens) - self.sent_end
        if pending <= p.final_switch_size:
            self._send_batch(now, final=True)
            return "final switch"
        if self.rounds + 1 >= p.max_rounds:
            return self._fall_back(now, "max rounds")
        if self.rounds > 0 and pending > p.min_shrink * self._last_batch:
            return self._fall_back(now, "not shrinking")
        why = self._divergence(pending)
        if why is not None:
            return self._fall_back(now, why)
        if pending < p.min_batch:
            self._ack_deadline = None
            return "wait"  # merge: let the remainder grow to min_batch
        self._send_batch(now, final=False)
        return "next round"

    # -------------------------------------------------------------- handlers
    def _on_token(self, ev: TokenGenerated, now: float) -> str:
        self._emit(ev.token, now, last=ev.finish is not None)
        if ev.finish is not None:
            return self._finish()
        if self._state is R.CATCHING_UP and self.acked == self.sent_end:
            label = self._plan(now)
            return "emit" if label == "wait" else label
        return "emit"

    def _on_finished(self, ev: RequestFinished, now: float) -> str:
        return self._finish()

    def _finish(self) -> str:
        if self._state is R.DECODING:
            # Strange traffic: the whole answer is out before MD's KV landed.
            self._out.append(CancelTransfer(AbortReason.RLD_FINISHED))
            self._abort(AbortReason.RLD_FINISHED)
        elif self._state is R.CATCHING_UP:
            self._abort(AbortReason.RLD_FINISHED)
        return "finished"

    def _on_kv_landed(self, ev: KvLanded, now: float) -> str:
        if self._state is R.DECODING:
            self._kv_deadline = None
            p = self.params
            if p.mode is HandoffMode.ONE_SHOT or len(self.tokens) <= p.catchup_threshold:
                self.handoff = "one-shot"
                self._send_batch(now, final=True)
                return "one-shot"
            self.handoff = "catch-up"
            label = self._plan(now)
            return "catch up" if label == "next round" else label
        if self._abort_sent is not None:
            # MD announces its KV after we gave up: tell it again to let go.
            self._abort(self._abort_sent)
            return "re-abort"
        return "ignore"

    def _on_ack(self, ev: BatchAcked, now: float) -> str:
        if self._state not in (R.DECODING, R.CATCHING_UP, R.SWITCHING):
            return "ignore"
        if ev.position > self.sent_end:
            raise RemoteProtocolError(
                f"ack at {ev.position} beyond the {self.sent_end} tokens sent", peer="md"
            )
        if ev.owner and ev.position != self.final_end:
            raise RemoteProtocolError(
                f"owner ack at {ev.position} but the final switch is at {self.final_end}",
                peer="md",
            )
        if ev.recompute_rate is not None:
            self.recompute_rate = (1 - _EWMA) * self.recompute_rate + _EWMA * ev.recompute_rate
        if self._state is R.SWITCHING and ev.owner:
            self.acked = ev.position
            self._ack_deadline = None
            return "released"
        if ev.position <= self.acked:
            return "ignore" if self._state is R.DECODING else "wait"
        self.acked = ev.position
        self._retries = 0
        if self.acked < self.sent_end or self._state is R.SWITCHING:
            self._arm_ack(now)  # still owed an ack (in SWITCHING: the owner ack)
            return "wait"
        self._ack_deadline = None
        return self._plan(now)

    def _on_peer_aborted(self, ev: PeerAborted, now: float) -> str:
        if self._state not in (R.DECODING, R.CATCHING_UP, R.SWITCHING):
            return "ignore"
        self._ack_deadline = None
        if ev.reason is AbortReason.CANCELLED:
            if self._state is R.DECODING:
                self._out.append(CancelTransfer(AbortReason.CANCELLED))
            return "cancelled"
        # MD will not take over (and, in SWITCHING, has not emitted): keep going.
        self.fallback = self.fallback or f"md aborted: {ev.reason.name.lower()}"
        return "resume" if self._state is R.SWITCHING else "keep"

    def _on_peer_failed(self, ev: PeerFailed, now: float) -> str:
        if self._state not in (R.DECODING, R.CATCHING_UP, R.SWITCHING):
            return "ignore"
        self._ack_deadline = None
        self.fallback = self.fallback or "md failed"
        if self._state is R.DECODING:
            self._out.append(CancelTransfer(AbortReason.MD_FAILED))
            return "keep"
        if self._state is R.CATCHING_UP:
            return "keep"
        if ev.user_position is not None and ev.user_position == self.final_end:
            return "resume"  # MD died before emitting anything: RLD still holds the KV
        self._fail(
            PeerUnavailable(
                f"MD failed after the final switch at {self.final_end}; "
                f"user stream at {ev.user_position}",
                peer="md",
            )
        )
        return "failed"

    def _on_timer(self, ev: Timer, now: float) -> str:
        shown = self._show_held(now, now)
        label = self._on_deadline(now)
        return "show" if shown and label == "wait" else label

    def _on_deadline(self, now: float) -> str:
        if self._state is R.DECODING:
            if self._kv_deadline is not None and now >= self._kv_deadline:
                self._kv_deadline = None
                self.fallback = "kv timeout"
                self._out.append(CancelTransfer(AbortReason.TIMEOUT))
                self._abort(AbortReason.TIMEOUT)
                return "kv timeout"
            return "wait"
        if self._state not in (R.CATCHING_UP, R.SWITCHING):
            return "ignore"
        if self._ack_deadline is None or now < self._ack_deadline:
            return "wait"
        if self._retries < self.params.max_retries:
            self._retransmit(now)
            return "retransmit"
        if self._state is R.CATCHING_UP:
            self._ack_deadline = None
            self.fallback = "ack timeout"
            self._abort(AbortReason.TIMEOUT)
            return "ack timeout"
        if not self._grace:
            # MD gives up after idle_timeout_s without our final batch and says
            # so; wait that long for its abort (then resume) or its owner ack.
            self._grace = True
            self._ack_deadline = now + self.params.idle_timeout_s + 2 * self.params.rtt_s
            return "wait"
        self._ack_deadline = None
        self._fail(
            TransferTimeout(
                f"no ack of the final switch at {self.final_end} after "
                f"{self._retries} retransmissions",
                peer="md",
            )
        )
        return "ack timeout"

    def _on_cancel(self, ev: Cancel, now: float) -> str:
        if self._state in (R.DECODING, R.CATCHING_UP, R.SWITCHING):
            if self._state is R.DECODING:
                self._out.append(CancelTransfer(AbortReason.CANCELLED))
            self._abort(AbortReason.CANCELLED)
            self._ack_deadline = None
            return "cancelled"
        if self._state is R.SOLO:
            return "cancelled"
        return "ignore"
