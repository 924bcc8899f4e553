"""The MD side of the handoff (see ``_state.py`` for the theory of operation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._errors import LocalProtocolError, PeerUnavailable, RemoteProtocolError, TransferTimeout
from ._events import (
    AbortReason,
    BatchReceived,
    Cancel,
    CancelTransfer,
    Emit,
    Event,
    FreeBlocks,
    KvLanded,
    PeerAborted,
    PeerFailed,
    RecomputeDone,
    RequestFinished,
    SendMessage,
    StartRecompute,
    TakeOver,
    Timer,
    TokenGenerated,
)
from ._machine import HandoffMachine
from ._messages import HandoffAbort, HandoffAck, KvReady
from ._params import HandoffParams
from ._state import MAIN_TABLE, MainState

__all__ = ["K_MAX_STASHED_BATCHES", "MainHandoff", "MainStats"]

M = MainState
K_MAX_STASHED_BATCHES = 64  # early (out-of-order) batches MD keeps before calling it abuse
_BEFORE_OWNER = (M.WAITING_KV, M.READY, M.RECOMPUTING)


@dataclass(frozen=True, slots=True)
class MainStats:
    """A snapshot of one request on MD.

    Attributes:
        state: the machine's state.
        tokens: tokens MD emitted to the user.
        recomputed: eager tokens whose KV MD recomputed.
        recomputes: extend passes run.
        takeover_position: where MD took over, once it did.
        max_gap_s: the largest gap between two of MD's emits.
        first_emit_at, last_emit_at: times of MD's first and last emits.
    """

    request_id: int
    state: MainState
    tokens: int
    recomputed: int
    recomputes: int
    takeover_position: int | None
    max_gap_s: float
    first_emit_at: float | None
    last_emit_at: float | None


class MainHandoff(HandoffMachine):
    """Sans-IO handoff machine of the MD side of one request.

    MD waits for the prompt KV (the WAN transfer), announces it, recomputes
    the token batches RLD sends, and takes over after the final batch.

    Args:
        request_id: the request's id (an unsigned 64-bit integer).
        params: handoff tuning (MD uses the deadlines and retries).
        now: the time the request started on MD.
        relayed: False on the P->MD route: there is no RLD, and MD takes the
            request over at position 0 as soon as the KV lands.
    """

    TABLE = MAIN_TABLE
    ERROR = M.ERROR
    HANDLERS: ClassVar[dict[type[Event], str]] = {
        TokenGenerated: "_on_token",
        RequestFinished: "_on_finished",
        KvLanded: "_on_kv_landed",
        BatchReceived: "_on_batch",
        RecomputeDone: "_on_recompute_done",
        PeerAborted: "_on_peer_aborted",
        PeerFailed: "_on_peer_failed",
        Timer: "_on_timer",
        Cancel: "_on_cancel",
    }

    def __init__(
        self,
        request_id: int,
        params: HandoffParams | None = None,
        *,
        now: float,
        relayed: bool = True,
    ) -> None:
        super().__init__(request_id, M.WAITING_KV, now)
        self.params = params or HandoffParams()
        self.relayed = relayed
        self.received: list[int] = []  # contiguous token ids from position 0
        self.recomputed = 0
        self.recomputes = 0
        self.final_end: int | None = None if relayed else 0
        self.position: int | None = None  # next position MD emits, once owner
        self._stash: dict[int, tuple[tuple[int, ...], bool]] = {}
        self._inflight: tuple[int, float] | None = None  # (end, started at)
        self._rate: float | None = None
        self._kv_deadline: float | None = now + self.params.kv_timeout_s
        self._idle_deadline: float | None = None
        self._ready_retry_at: float | None = None
        self._ready_retries = 0
        self._recompute_deadline: float | None = None
        self._abort_sent: AbortReason | None = None
        self._rld_dead = False

    # ------------------------------------------------------------ public API
    @property
    def state(self) -> MainState:
        """The current :class:`MainState`."""
        assert isinstance(self._state, MainState)
        return self._state

    @property
    def may_decode(self) -> bool:
        """Whether MD owns the request and may run decode steps."""
        return self._state is M.OWNER

    def get_timer(self) -> float | None:
        """The next deadline at which the driver must feed :class:`Timer`, or None."""
        s = self._state
        if s is M.WAITING_KV:
            return self._kv_deadline
        if s is M.READY:
            times = [t for t in (self._idle_deadline, self._ready_retry_at) if t is not None]
            return min(times) if times else None
        if s is M.RECOMPUTING:
            return self._recompute_deadline
        return None

    def statistics(self, now: float) -> MainStats:
        """A frozen snapshot of this request's MD-side metrics."""
        return MainStats(
            self.request_id,
            self.state,
            self.emitted,
            self.recomputed,
            self.recomputes,
            self.final_end if self.position is not None else None,
            self.max_gap_s,
            self.first_emit_at,
            self.last_emit_at,
        )

    # --------------------------------------------------------------- helpers
    def _send(self, message: HandoffAck | KvReady | HandoffAbort) -> None:
        if self._rld_dead:
            return  # nobody to tell, and a send to a dead peer only waits out its timeout
        self._out.append(SendMessage(message))

    def _ack(self, owner: bool = False) -> None:
        rate = int(self._rate) if self._rate else 0
        self._send(HandoffAck(self.request_id, self.recomputed, owner, rate))

    def _abort(self, reason: AbortReason) -> None:
        self._abort_sent = reason
        self._send(HandoffAbort(self.request_id, int(reason)))

    def _release(self, reason: AbortReason) -> None:
        """Leave before owning: cancel the transfer if still in flight, free blocks."""
        if self._state is M.WAITING_KV:
            self._out.append(CancelTransfer(reason))
        self._out.append(FreeBlocks())

    def _absorb(self, ev: BatchReceived) -> bool:
        """Merge a batch into the contiguous prefix; True if anything was new."""
        if ev.start > len(self.received):
            if len(self._stash) >= K_MAX_STASHED_BATCHES and ev.start not in self._stash:
                raise RemoteProtocolError("too many out-of-order token batches", peer="rld")
            prev = self._stash.get(ev.start)
            if prev is None or len(ev.tokens) > len(prev[0]) or ev.final:
                self._stash[ev.start] = (ev.tokens, ev.final or (prev is not None and prev[1]))
            return False
        before = len(self.received)
        self._append(ev.start, ev.tokens, ev.final)
        while self._stash:
            ready = [s for s in self._stash if s <= len(self.received)]
            if not ready:
                break
            for s in sorted(ready):
                toks, final = self._stash.pop(s)
                self._append(s, toks, final)
        return len(self.received) > before or (ev.final and self.final_end is not None)

    def _append(self, start: int, tokens: tuple[int, ...], final: bool) -> None:
        have = self.received[start : start + len(tokens)]
        if list(tokens[: len(have)]) != have:
            raise RemoteProtocolError(
                f"batch at {start} contradicts tokens already held", peer="rld"
            )
        end = start + len(tokens)
        if self.final_end is not None and end > self.final_end:
            raise RemoteProtocolError(
                f"tokens beyond the final switch at {self.final_end}", peer="rld"
            )
        if final:
            if self.final_end is not None and self.final_end != end:
                raise RemoteProtocolError("two different final switches", peer="rld")
            if len(self.received) > end:
                raise RemoteProtocolError("final switch before tokens already held", peer="rld")
            self.final_end = end
        self.received.extend(tokens[len(have) :])

    def _step(self, now: float, idle: str) -> str:
        """KV is here and no extend is running: recompute, take over, or wait."""
        if len(self.received) > self.recomputed:
            start, toks = self.recomputed, tuple(self.received[self.recomputed :])
            self._out.append(StartRecompute(start, toks))
            self._inflight = (len(self.received), now)
            rate = self._rate or self.params.recompute_rate
            self._recompute_deadline = now + self.params.recompute_timeout_s + len(toks) / rate
            self.recomputes += 1
            return "recompute"
        if self.final_end is not None and self.recomputed == self.final_end:
            self._take_over()
            return "take over"
        self._idle_deadline = now + self.params.idle_timeout_s
        return idle

    def _take_over(self) -> None:
        assert self.final_end is not None
        self.position = self.final_end
        self._idle_deadline = self._ready_retry_at = self._recompute_deadline = None
        if self.relayed:
            self._ack(owner=True)
        self._out.append(TakeOver(self.final_end))

    # -------------------------------------------------------------- handlers
    def _on_token(self, ev: TokenGenerated, now: float) -> str:
        assert self.position is not None
        self._out.append(Emit(self.position, ev.token))
        self.position += 1
        self._note_emit(now)
        return "finished" if ev.finish is not None else "emit"

    def _on_finished(self, ev: RequestFinished, now: float) -> str:
        return "finished"

    def _on_kv_landed(self, ev: KvLanded, now: float) -> str:
        if self._state is not M.WAITING_KV:
            return "ignore"  # the transfer completed while we were leaving
        self._kv_deadline = None
        if self.relayed:
            self._send(KvReady(self.request_id))
            self._ready_retry_at = now + self.params.ack_timeout_s + self.params.rtt_s
        return self._step(now, "ready")

    def _on_batch(self, ev: BatchReceived, now: float) -> str:
        s = self._state
        if s is M.OWNER or s is M.FINISHED:
            self._ack(owner=True)
            return "re-ack"
        if s not in _BEFORE_OWNER:
            if self._abort_sent is not None:
                self._abort(self._abort_sent)
                return "re-abort"
            return "ignore"
        new = self._absorb(ev)
        self._ready_retry_at = None  # RLD heard our KvReady
        if s is M.READY:
            return self._step(now, "buffer") if new else self._dup(now)
        if s is M.RECOMPUTING and not new:
            self._ack()
        return "buffer"

    def _dup(self, now: float) -> str:
        self._ack()  # answer a retransmission with where we are
        self._idle_deadline = now + self.params.idle_timeout_s
        return "buffer"

    def _on_recompute_done(self, ev: RecomputeDone, now: float) -> str:
        if self._state is not M.RECOMPUTING:
            return "ignore"  # finished after we aborted; blocks already released
        assert self._inflight is not None
        end, started = self._inflight
        if ev.position != end:
            raise LocalProtocolError(f"recompute reported {ev.position}, expected {end}")
        if now > started:
            sample = (end - self.recomputed) / (now - started)
            self._rate = sample if self._rate is None else 0.5 * self._rate + 0.5 * sample
        self.recomputed = end
        self._inflight = None
        self._recompute_deadline = None
        label = self._step(now, "ready")
        if label != "take over":
            self._ack()
        return label

    def _on_peer_aborted(self, ev: PeerAborted, now: float) -> str:
        s = self._state
        if s is M.OWNER:
            if ev.reason is not AbortReason.CANCELLED:
                raise RemoteProtocolError(
                    f"RLD aborted ({ev.reason.name}) after handing over", peer="rld"
                )
            return "cancelled"
        if s not in _BEFORE_OWNER:
            return "ignore"
        self._release(ev.reason)
        return "cancelled" if ev.reason is AbortReason.CANCELLED else "aborted"

    def _user_stream_fits(self, u: int | None, tokens: tuple[int, ...] | None) -> bool:
        """Whether MD can take over exactly at the user's position ``u``: it
        holds those ``u`` tokens (or gets the rest from ``tokens``, which must
        agree with what it holds) and no final switch says otherwise."""
        if u is None or (self.final_end is not None and self.final_end != u):
            return False
        held = len(self.received)
        if tokens is None:
            return held == u
        return len(tokens) == u and held <= u and list(tokens[:held]) == self.received

    def _on_peer_failed(self, ev: PeerFailed, now: float) -> str:
        s = self._state
        if s not in _BEFORE_OWNER:
            return "ignore"
        u = ev.user_position
        fits = self._user_stream_fits(u, ev.user_tokens)
        if ev.takeover_only and not fits:
            return "continue"  # only a suspicion: RLD may still hand over; the detector decides
        if fits and ev.user_tokens is not None and u is not None:
            # the user's stream is RLD's whole output: take it as the final batch
            self._append(0, ev.user_tokens, final=True)
            self._stash.clear()
        self._rld_dead = True
        if self.final_end is None and u is not None and u == len(self.received):
            self.final_end = u  # the user saw exactly what we hold: finish the switch
            self._stash.clear()
        if self.final_end is not None and len(self.received) == self.final_end:
            if s is M.READY:
                return self._step(now, "continue")  # recompute or take over
            return "continue"
        self._fail(
            PeerUnavailable(
                f"RLD failed before the final switch; MD holds {len(self.received)} tokens, "
                f"user stream at {u}",
                peer="rld",
            )
        )
        self._release(AbortReason.RLD_FAILED)
        return "failed"

    def _on_timer(self, ev: Timer, now: float) -> str:
        s = self._state
        p = self.params
        if s is M.WAITING_KV:
            if self._kv_deadline is not None and now >= self._kv_deadline:
                return self._give_up(AbortReason.TIMEOUT, "kv timeout", "the KV never landed")
            return "wait"
        if s is M.READY:
            if self._idle_deadline is not None and now >= self._idle_deadline:
                return self._give_up(AbortReason.TIMEOUT, "idle timeout", "no batch from RLD")
            if self._ready_retry_at is not None and now >= self._ready_retry_at:
                if self._ready_retries < p.max_retries:
                    self._ready_retries += 1
                    self._send(KvReady(self.request_id))
                    self._ready_retry_at = now + p.ack_timeout_s + p.rtt_s
                    return "retransmit"
                self._ready_retry_at = None
            return "wait"
        if s is M.RECOMPUTING:
            if self._recompute_deadline is not None and now >= self._recompute_deadline:
                return self._give_up(
                    AbortReason.MD_FAILED, "recompute timeout", "the recompute did not finish"
                )
            return "wait"
        return "ignore"

    def _give_up(self, reason: AbortReason, label: str, what: str) -> str:
        """A deadline passed before MD owned the request."""
        self._release(reason)
        if self._rld_dead:
            # We had promised to finish the switch alone: nobody else can.
            self._fail(TransferTimeout(f"{what} after RLD failed", peer="rld"))
            return "failed"
        self._abort(reason)  # RLD keeps (or resumes) the request
        return label

    def _on_cancel(self, ev: Cancel, now: float) -> str:
        s = self._state
        if s is M.OWNER:
            return "cancelled"
        if s not in _BEFORE_OWNER:
            return "ignore"
        self._release(AbortReason.CANCELLED)
        self._abort(AbortReason.CANCELLED)
        return "cancelled"
