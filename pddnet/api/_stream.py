"""The sink's sans-IO stream assembler: a request's tokens, in order, with no holes.

Decoders send the user's tokens as one-way ``Emitted`` frames. A one-way frame
can be lost: zmq discards the frames still queued on a TCP connection that
resets, and a process can die with tokens in its queue. The assembler is the
sink's end-to-end check on top of that. It reorders tokens by position, drops
exact duplicates, and ends the stream only when every position from 0 to the
final one arrived.

When it sees a hole, or hears nothing for a while, it asks for a *round*: the
driver sends ``StreamResend`` to every decoder that may hold the request, and
each answers with its ``StreamStatus`` after re-sending the tokens it holds.
Those answers tell the assembler whether anyone can still deliver the
stream. A round is *healthy* if some decoder is still serving the request
(``ACTIVE``) or holds the next missing position. Until the stream knows a
decoder (named by the sink's owner, or seen in a token) only its deadline
can end it. After ``max_failed_rounds``
unhealthy rounds in a row (the serving decoder died, or restarted and forgot
the request) the stream fails with :class:`~pddnet.PeerUnavailable`; so it
does after ``max_failed_rounds`` rounds in a row in which a decoder said it
holds the next position, as it had said the round before, and nothing arrived
in between (its re-sends are lost on the way: the stream would otherwise look
healthy until its deadline); past its
deadline it fails with :class:`~pddnet.TransferTimeout`; an ``Abort`` from a
decoder fails it with :class:`~pddnet.RequestAborted`. A stream therefore
always ends, complete or with a typed error.

On the P->RLD->MD route the sink also watches for a dead relay. When the
stream knows its relay and main decoder (:meth:`StreamAssembler.set_handoff`)
and a round gets no answer from RLD (or RLD has forgotten the request) while
MD answers ``ACTIVE`` without having emitted anything, MD is waiting for a
handover that will never come. The assembler then proposes a *takeover*
(:meth:`StreamAssembler.takeover`): the driver tells MD the user's position
and tokens (``StreamTakeover``), and MD takes over there if its handoff
machine can do so without a duplicate or a gap. Without it MD would wait for
its own failure detector (seconds), and the user's deadline could pass first.

Time is explicit: every method takes ``now`` and :meth:`next_timer` says when
:meth:`poll` next has work.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .._errors import (
    PddnetError,
    PeerUnavailable,
    RemoteProtocolError,
    RequestAborted,
    TransferTimeout,
)

__all__ = ["SourceState", "StreamAssembler", "StreamPhase", "StreamReport"]


class SourceState(enum.IntEnum):
    """What a decoder says about a request in ``StreamStatus``."""

    ACTIVE = 0  # serving it: more tokens may come
    DONE = 1  # emitted its last token of the request (the stream's final one, or a handover)
    UNKNOWN = 2  # no record: never had it, forgot it (a restart), or acknowledged already
    FAILED = 3  # gave up on it (and sent an Abort, which may have been lost)


class StreamPhase(enum.Enum):
    OPEN = "open"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class StreamReport:
    """One decoder's answer in a round (None in a round: it did not answer)."""

    state: SourceState
    first: int  # first position it emitted, -1 if none
    last: int  # last position it emitted, -1 if none
    detail: str = ""


class StreamAssembler:
    """Assembles one request's token stream.

    Args:
        request_id: the request.
        now: the time the stream opened.
        deadline: absolute time by which it must end (``inf``: none).
        max_tokens: positions ``>= max_tokens`` are protocol errors.
        gap_delay_s: how long a hole may stay open before a round asks for it
            (tokens of the two decoders cross at the handover, so a short hole
            is normal).
        poll_interval_s: silence before a round, and the spacing of rounds.
        max_failed_rounds: unhealthy rounds in a row before the stream fails.
    """

    def __init__(
        self,
        request_id: int,
        now: float,
        *,
        deadline: float = math.inf,
        max_tokens: int = 1 << 20,
        gap_delay_s: float = 0.05,
        poll_interval_s: float = 1.0,
        max_failed_rounds: int = 3,
    ) -> None:
        if max_tokens < 1 or gap_delay_s < 0 or poll_interval_s <= 0 or max_failed_rounds < 1:
            raise ValueError("bad stream parameters")
        self.request_id = request_id
        self.deadline = deadline
        self.max_tokens = max_tokens
        self.gap_delay_s = gap_delay_s
        self.poll_interval_s = poll_interval_s
        self.max_failed_rounds = max_failed_rounds
        self.phase = StreamPhase.OPEN
        self.error: PddnetError | None = None
        self.sources: list[str] = []  # decoders that may hold the request, in order seen
        self.relay = ""  # the request's RLD and MD, when known (set_handoff)
        self.main = ""
        self.takeovers = 0  # takeovers proposed
        self.delivered: list[int] = []  # the tokens at positions 0..next-1
        self.next = 0  # every position below this has been delivered
        self.final: int | None = None
        self.duplicates = 0
        self.rounds = 0
        self.failed_rounds = 0
        self.unfulfilled_rounds = 0  # rounds in a row: the next position held, none arrived
        self._held = False  # the last round's answers: someone holds the next position
        self._pending: dict[int, tuple[int, str]] = {}  # position -> (token, source)
        self._progress_at = now  # last time ``next`` advanced (or the stream opened)
        self._gap_since: float | None = None
        self._round_at = -math.inf  # when the last round started
        self._in_round = False
        self._takeover: int | None = None  # position of a proposed, not yet taken, takeover
        self._round_next = 0  # ``next`` when the last round started

    # ------------------------------------------------------------- inputs
    def add_sources(self, names: Iterable[str]) -> None:
        for name in names:
            if name and name not in self.sources:
                self.sources.append(name)

    def set_handoff(self, relay: str, main: str) -> None:
        """The request runs P->RLD->MD: ``relay`` emits first, ``main`` takes over.

        Both become sources; a round in which ``relay`` is silent while
        ``main`` waits proposes a takeover (:meth:`takeover`).
        """
        if relay and main and relay != main:
            self.relay, self.main = relay, main
            self.add_sources([main, relay])

    def receive(
        self, position: int, token: int, finished: bool, source: str, now: float
    ) -> list[tuple[int, int, str]]:
        """A token arrived; returns the ``(position, token, source)`` now deliverable, in order.

        A malformed token (a position out of range, a second final, the same
        position with another token) fails the stream with
        :class:`~pddnet.RemoteProtocolError`.
        """
        if self.phase is not StreamPhase.OPEN:
            return []
        self.add_sources([source])
        try:
            self._check(position, token, finished)
        except RemoteProtocolError as exc:
            self._fail(exc)
            return []
        if finished:
            self.final = position
        if position < self.next or position in self._pending:
            self.duplicates += 1
            return []
        self._pending[position] = (token, source)
        out = []
        while self.next in self._pending:
            tok, src = self._pending.pop(self.next)
            out.append((self.next, tok, src))
            self.delivered.append(tok)
            self.next += 1
        if out:
            self._progress_at = now
            self.failed_rounds = self.unfulfilled_rounds = 0
            self._held = False
        if not self._pending:
            self._gap_since = None
        elif self._gap_since is None:
            self._gap_since = now
        if self.final is not None and self.next > self.final:
            self.phase = StreamPhase.FINISHED
        return out

    def _check(self, position: int, token: int, finished: bool) -> None:
        rid = self.request_id
        if not 0 <= position < self.max_tokens:
            raise RemoteProtocolError(f"token position {position} out of range", request_id=rid)
        if self.final is not None and (
            position > self.final or (finished and position != self.final)
        ):
            raise RemoteProtocolError(
                f"token at {position} but the stream ends at {self.final}", request_id=rid
            )
        if finished and self._pending and max(self._pending) > position:
            raise RemoteProtocolError(
                f"final token at {position} after position {max(self._pending)}", request_id=rid
            )
        pending = self._pending.get(position)
        if position < self.next:
            seen: int | None = self.delivered[position]
        else:
            seen = None if pending is None else pending[0]
        if seen is not None and seen != token:
            raise RemoteProtocolError(
                f"two different tokens at position {position}", request_id=rid
            )

    def abort(self, reason: str, source: str) -> None:
        """A decoder aborted the request."""
        if self.phase is StreamPhase.OPEN:
            self._fail(RequestAborted(reason, peer=source, request_id=self.request_id))

    def round_result(self, reports: Mapping[str, StreamReport | None], now: float) -> None:
        """The answers of the round :meth:`poll` asked for (None: no answer)."""
        self._in_round = False
        if self.phase is not StreamPhase.OPEN:
            return
        for source, rep in reports.items():
            if rep is not None and rep.state is SourceState.FAILED:
                detail = rep.detail or "the decoder gave up on the request"
                self._fail(RequestAborted(detail, peer=source, request_id=self.request_id))
                return
        healthy = any(
            rep is not None
            and (rep.state is SourceState.ACTIVE or rep.first <= self.next <= rep.last)
            for rep in reports.values()
        )
        stalled = self.next == self._round_next  # (answers are older than tokens since)
        self._takeover = self.next if stalled and self._relay_lost(reports) else None
        self.failed_rounds = 0 if healthy else self.failed_rounds + 1
        holders = [
            s
            for s, rep in reports.items()
            if rep is not None and rep.first <= self.next <= rep.last
        ]
        # the previous round's holders re-sent the next position then: nothing came
        unfulfilled = stalled and bool(holders) and self._held
        self._held = bool(holders)
        self.unfulfilled_rounds = self.unfulfilled_rounds + 1 if unfulfilled else 0
        if self.unfulfilled_rounds >= self.max_failed_rounds:
            self._fail(
                PeerUnavailable(
                    f"{', '.join(holders)} holds position {self.next} but no re-send of it"
                    f" arrived in {self.unfulfilled_rounds} rounds",
                    peer=holders[0],
                    request_id=self.request_id,
                    state=self.phase,
                )
            )
            return
        if self.failed_rounds >= self.max_failed_rounds:
            said = ", ".join(
                f"{s}: {'no answer' if r is None else r.state.name}" for s, r in reports.items()
            )
            self._fail(
                PeerUnavailable(
                    f"no decoder can deliver position {self.next} ({said or 'no known decoder'})",
                    request_id=self.request_id,
                    state=self.phase,
                )
            )

    def _relay_lost(self, reports: Mapping[str, StreamReport | None]) -> bool:
        """RLD cannot deliver (no answer, or no record of the request) while
        MD still serves the request and has emitted nothing: MD waits for a
        handover that will not come. (Only asked when no token arrived
        during the round.)"""
        if not self.relay or self.relay not in reports or self.main not in reports:
            return False
        rld, md = reports[self.relay], reports[self.main]
        rld_gone = rld is None or rld.state is SourceState.UNKNOWN
        return rld_gone and md is not None and md.state is SourceState.ACTIVE and md.first < 0

    def takeover(self) -> tuple[str, int] | None:
        """After :meth:`round_result`: ``(main, position)`` if MD should be told
        that RLD is gone and the user's stream holds ``position`` tokens
        (``delivered[:position]``); None otherwise. Each proposal is returned once.
        """
        pos, self._takeover = self._takeover, None
        if pos is None or self.phase is not StreamPhase.OPEN or pos != self.next:
            return None
        self.takeovers += 1
        return self.main, pos

    def close(self, reason: str = "closed by the sink") -> None:
        """The consumer gave up on the stream."""
        if self.phase is StreamPhase.OPEN:
            self._fail(RequestAborted(reason, request_id=self.request_id))

    # ------------------------------------------------------------ outputs
    def next_timer(self) -> float:
        """When :meth:`poll` next has something to do (``inf``: never)."""
        if self.phase is not StreamPhase.OPEN:
            return math.inf
        t = self.deadline
        if not self._in_round and self.sources:  # nobody to ask yet: only the deadline
            due = self._progress_at + self.poll_interval_s
            if self._gap_since is not None:
                due = min(due, self._gap_since + self.gap_delay_s)
            t = min(t, max(due, self._round_at + self.poll_interval_s))
        return t

    def poll(self, now: float) -> bool:
        """Check the timers; True when the driver should run a round now.

        Past the deadline the stream fails instead.
        """
        if self.phase is not StreamPhase.OPEN:
            return False
        if now >= self.deadline:
            self._fail(
                TransferTimeout(
                    f"the stream stopped at position {self.next} by its deadline",
                    request_id=self.request_id,
                )
            )
            return False
        if self._in_round or now < self.next_timer():
            return False
        self._in_round = True
        self._round_at = now
        self._round_next = self.next
        self.rounds += 1
        return True

    def _fail(self, error: PddnetError) -> None:
        self.phase = StreamPhase.FAILED
        self.error = error
        self._pending.clear()
