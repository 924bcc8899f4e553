"""Trio drivers: connect the handoff machines to an engine and a message link.

A driver owns one machine for one request. One task feeds it events, in
order, from a single inbox (messages from the peer, KV landing, failure
reports, a cancel) and the engine's tokens, and acts on its outputs, so the
machine never sees two events at once and never waits on the engine. Queued
events go first, then a timer that passed, then one token at a time: a
failure report or a cancel never waits behind a run of tokens (each emit may
wait on the sink). Otherwise the driver sleeps until ``machine.get_timer()``
and then feeds :class:`Timer`, so every wait inherits the machine's deadlines.

The engine is reached only through :class:`~pddnet.handoff.DecodeEngine`: the
driver asks it to continue the request (the tokens so far, the blocks with
their KV) and consumes the tokens it produces; the engine steps when it
likes, batched with its other requests. Tokens that arrive while the machine
may not emit (RLD sent its final batch; MD finished a catch-up round but does
not own the request yet) are kept, in order, and the engine is stopped: should
the machine decode again (MD refused and RLD resumes; MD takes over), the kept
tokens are fed first and the engine continues after them. MD's recompute of a
batch of RLD's tokens is a continue of prompt + those tokens with the KV it
already holds; the first token that run produces completes the round
(:class:`RecomputeDone`) and is the one at the round's end position. A later
round restarts the request with a longer prefix.
"""

from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass
from typing import Protocol

import trio

from .._errors import LocalProtocolError, PddnetError, RemoteProtocolError, TransferTimeout
from ..wire import Message
from ._engine import DecodeEngine, DecodeRequest
from ._events import (
    AbortReason,
    Cancel,
    CancelTransfer,
    Done,
    Emit,
    Event,
    FinishReason,
    FreeBlocks,
    KvLanded,
    Output,
    PeerFailed,
    RecomputeDone,
    SendMessage,
    StartRecompute,
    TakeOver,
    Timer,
    TokenGenerated,
)
from ._machine import HandoffMachine
from ._main import MainHandoff
from ._messages import FirstToken, event_for_message
from ._params import HandoffParams
from ._relay import RelayHandoff

__all__ = ["HandoffDriver", "HandoffRequest", "Link", "MainDriver", "RelayDriver", "TokenOut"]

log = logging.getLogger("pddnet.handoff")
# Peer messages queued for one request at most; a well-behaved peer has a
# handful in flight (a batch, an ack, a retransmission).
K_MAX_PEER_BACKLOG = 256


@dataclass(frozen=True, slots=True)
class HandoffRequest:
    """The request a driver runs on its engine.

    Attributes:
        request_id: the request.
        prompt: the prompt's token ids.
        block_table: the request's KV blocks (the prompt's KV lands in the first ones).
        max_tokens: the user's stream holds at most this many tokens.
        first_token: the token P's prefill produced (position 0), where this
            side knows it (RLD; MD on the P->MD route). MD behind RLD gets it
            in RLD's first batch. None on RLD or P->MD's MD means it follows
            in a :class:`~pddnet.handoff.FirstToken` (P shipped the KV before
            sampling): the driver decodes from position 0 once it came, and
            fails the request with :class:`~pddnet.TransferTimeout` if it does
            not come within ``kv_timeout_s`` of the driver being ready for it.
    """

    request_id: int
    prompt: tuple[int, ...]
    block_table: tuple[int, ...]
    max_tokens: int
    first_token: int | None = None


class TokenOut(Protocol):
    """Where the user's tokens go (the endpoint's sink connection)."""

    async def emit(self, request_id: int, position: int, token: int, final: bool) -> None:
        """Deliver ``token`` at ``position`` of the user's stream (``final``: the last one)."""
        ...


@dataclass(frozen=True, slots=True)
class _EngineWake(Event):
    """(driver-internal) the engine produced tokens (they wait in ``_fresh``)."""


@dataclass(frozen=True, slots=True)
class _EngineEnded(Event):
    """(driver-internal) the engine's run number ``run`` returned."""

    run: int


@dataclass(frozen=True, slots=True)
class _FirstTokenCame(Event):
    """(driver-internal) P's :class:`FirstToken` arrived (``_first_token`` holds it)."""


@dataclass(frozen=True, slots=True)
class _FirstTokenLate(Event):
    """(driver-internal) the wait for P's :class:`FirstToken` ran out."""


@dataclass(frozen=True, slots=True)
class _FirstTokenTwice(Event):
    """(driver-internal) P sent a first token the request already had."""


class Link(Protocol):
    """Where a driver's messages go, and what it does around the transfer."""

    async def send(self, message: Message) -> None:
        """Send a control message to the peer of this request."""
        ...

    async def cancel_transfer(self, request_id: int, reason: AbortReason) -> None:
        """Cancel the P->MD WAN transfer of the request."""
        ...

    async def free_blocks(self, request_id: int) -> None:
        """(MD) free the KV blocks reserved for the request."""
        ...


class HandoffDriver:
    """Common loop of :class:`RelayDriver` and :class:`MainDriver`."""

    machine: HandoffMachine

    def __init__(
        self,
        engine: DecodeEngine,
        link: Link,
        out: TokenOut,
        request: HandoffRequest,
        params: HandoffParams,
    ) -> None:
        self.engine = engine
        self.link = link
        self.out = out
        self.request = request
        self.request_id = request.request_id
        self.params = params
        self._send_in, self._inbox = trio.open_memory_channel[Event](math.inf)
        self._from_peer: set[int] = set()  # ids of queued events that came from the peer
        self.dropped = 0  # peer messages dropped because too many were queued
        self._sending: trio.CancelScope | None = None  # around a send to the peer in progress
        self.result: Done | None = None
        # the user's stream as this side knows it (position = index): emitted,
        # kept for later, or (MD) RLD's tokens being recomputed
        self._stream: list[int] = []
        self._kept: collections.deque[TokenGenerated] = collections.deque()  # not yet fed
        # the engine's tokens as they come: (run, token, finish), not yet kept
        self._fresh: collections.deque[tuple[int, int, FinishReason | None]] = collections.deque()
        self._woken = False  # an _EngineWake is queued
        self._finish_at: int | None = None  # the position whose token ends the request
        self._kv = len(request.prompt)  # leading tokens (prompt + stream) with KV in the blocks
        self._run = 0  # the engine run whose tokens count; earlier runs' are stale
        self._engine_on = False  # a run is wanted (started and neither stopped nor finished)
        self._run_ended: trio.Event | None = None  # set when the latest run task returned
        self._round_end: int | None = None  # (MD) the recompute round awaiting its first token
        self._first_token = request.first_token  # P's, once known (from the offer or FirstToken)
        self._first_token_timer = False  # the wait for P's FirstToken is timed
        self._first_token_twice = False  # a second one came (the request fails)

    # ----------------------------------------------------- inputs, thread-free
    def deliver(self, message: Message) -> None:
        """Hand the driver a message from the peer (never blocks).

        A malformed message is logged and dropped: the peer's retransmissions
        or the machine's deadlines recover. P's :class:`FirstToken` (which the
        hub checked) is the driver's own; a second one fails the request.
        """
        if isinstance(message, FirstToken):
            self._first_token_arrived(message.token)
            return
        try:
            ev = event_for_message(message)
        except PddnetError as exc:
            log.warning("request %s: dropped bad message: %s", self.request_id, exc)
            return
        if len(self._from_peer) >= K_MAX_PEER_BACKLOG:
            # a peer far ahead of us (or flooding): its retransmissions recover
            self.dropped += 1
            if self.dropped == 1:
                log.warning("request %s: peer backlog full, dropping", self.request_id)
            return
        self._from_peer.add(id(ev))
        self._send_in.send_nowait(ev)

    def peer_failed(
        self,
        user_position: int | None = None,
        user_tokens: tuple[int, ...] | None = None,
        *,
        takeover_only: bool = False,
    ) -> None:
        """The failure detector declared the peer dead (never blocks).

        With ``takeover_only`` it is a suspicion (see :class:`PeerFailed`):
        MD acts on it only to take over at ``user_position``.

        A send to the peer in progress is abandoned (it would only wait out
        its timeout on a dead peer, and hold up this report); the machines
        recover a message lost that way as any other.
        """
        self._send_in.send_nowait(PeerFailed(user_position, user_tokens, takeover_only))
        if self._sending is not None:
            self._sending.cancel()

    def cancel(self) -> None:
        """The user cancelled the request (never blocks)."""
        self._send_in.send_nowait(Cancel())

    # ------------------------------------------------------------------ loop
    async def run(self) -> Done:
        """Drive the request until the machine is done.

        Returns:
            The machine's final :class:`Done` output (``error`` set on failure).

        Raises:
            LocalProtocolError: if the machine rejects an event, or the engine
                breaks its contract (a bug in the engine). A misbehaving peer
                (RemoteProtocolError) fails the request instead:
                ``Done(ERROR, error)``, blocks freed.

        Cancellation: the engine's run is cancelled (it returns once the engine
        no longer touches the request's blocks); the machine is left in its
        current state and nothing is freed. Feed :meth:`cancel` and let ``run``
        return instead, to release resources cleanly.
        """
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._steer()
            while self.result is None:
                await self._next()
            self._stop_engine()
            nursery.cancel_scope.cancel()
        return self.result

    async def _next(self) -> None:
        """Act on one thing, in this order: a queued event (a failure report or
        a cancel never waits behind tokens), a timer that passed, the engine's
        next token; else sleep until an event or the machine's timer."""
        deadline = self.machine.get_timer()
        try:
            ev = self._inbox.receive_nowait()
        except trio.WouldBlock:
            if deadline is not None and trio.current_time() >= deadline:
                ev = Timer()
            elif self._fresh or (self._kept and self.machine.may_decode):
                await self._absorb()
                if self._kept and self.result is None and self.machine.may_decode:
                    await self._handle(self._kept.popleft())
                self._steer()
                await trio.lowlevel.checkpoint()
                return
            else:
                ev = Timer()
                with trio.move_on_at(deadline if deadline is not None else math.inf):
                    ev = await self._inbox.receive()
        else:
            await trio.lowlevel.checkpoint()
        self._from_peer.discard(id(ev))
        await self._feed(ev)

    async def _feed(self, ev: Event) -> None:
        if isinstance(ev, _EngineWake):
            self._woken = False
            return
        if isinstance(ev, _EngineEnded):
            await self._absorb()  # its last tokens came before it
            if ev.run == self._run and self._engine_on:
                raise LocalProtocolError(
                    "the engine ended the request without a finish reason",
                    request_id=self.request_id,
                )
            return
        if isinstance(ev, _FirstTokenCame | _FirstTokenLate | _FirstTokenTwice):
            await self._on_first_token_event(ev)
        else:
            await self._handle(ev)
        self._steer()

    async def _absorb(self) -> None:
        """Keep the engine's new tokens (a stopped run's are dropped); on MD the
        first token of a recompute round completes the round."""
        while self._fresh:
            run, token, finish = self._fresh.popleft()
            if run != self._run or not self._engine_on:
                continue  # from a run we stopped
            self._keep(token, finish)
            if self._round_end is not None:
                end, self._round_end = self._round_end, None
                await self._handle(RecomputeDone(end))

    async def _handle(self, ev: Event) -> None:
        try:
            outs = self.machine.handle(ev, trio.current_time())
        except RemoteProtocolError as exc:
            # The peer broke the protocol: fail this request, keep the process.
            await self._fail(exc)
            return
        await self._act(outs)

    async def _fail(self, exc: PddnetError) -> None:
        """End the request with ``exc``, freeing the blocks this side holds for it."""
        log.warning("request %s: %s", self.request_id, exc)
        outs: list[Output] = [FreeBlocks()] if self._holds_unowned_blocks() else []
        outs.append(Done(self.machine.state, exc))
        await self._act(outs)

    def _keep(self, token: int, finish: FinishReason | None) -> None:
        """A new token at the stream's end (from the engine, or P's first token)."""
        position = len(self._stream)
        if position:  # the engine produced it: every token before it has KV now
            self._kv = len(self.request.prompt) + position
        self._stream.append(token)
        if finish is not None:
            self._finish_at = position
            self._engine_on = False  # the engine's run ends with this token
        self._kept.append(TokenGenerated(token, finish))

    def _steer(self) -> None:
        """Run the engine exactly while the machine may decode (or MD recomputes)."""
        if self.result is not None or self.machine.done:
            self._stop_engine()
        elif self.machine.may_decode:
            if not self._engine_on and self._finish_at is None and not self._kept:
                if not self._stream and not self._seed_first_token():
                    return  # P's first token follows: _FirstTokenCame steers again
                if self._finish_at is None:
                    self._start_engine()
        elif self._round_end is None:
            self._stop_engine()

    def _seed_first_token(self) -> bool:
        """Keep P's first token as position 0; False while it has not come."""
        first = self._first_token
        if first is None:
            if not self._first_token_timer:
                self._first_token_timer = True
                self._nursery.start_soon(self._time_first_token)
            return False
        eos = self.engine.eos_token_id
        finish: FinishReason | None = None
        if eos is not None and first == eos:
            finish = FinishReason.EOS
        elif self.request.max_tokens <= 1:
            finish = FinishReason.MAX_TOKENS
        self._keep(first, finish)
        return True

    def _first_token_arrived(self, token: int) -> None:
        if self._first_token is None:
            self._first_token = token
            self._send_in.send_nowait(_FirstTokenCame())
        elif not self._first_token_twice:  # one failure, however many come
            self._first_token_twice = True
            self._send_in.send_nowait(_FirstTokenTwice())

    async def _time_first_token(self) -> None:
        await trio.sleep(self.params.kv_timeout_s)
        self._send_in.send_nowait(_FirstTokenLate())

    async def _on_first_token_event(
        self, ev: _FirstTokenCame | _FirstTokenLate | _FirstTokenTwice
    ) -> None:
        if isinstance(ev, _FirstTokenTwice):
            await self._fail(
                RemoteProtocolError(
                    "P's first token came twice", peer="prefill", request_id=self.request_id
                )
            )
        elif isinstance(ev, _FirstTokenLate) and self._first_token is None:
            await self._fail(
                TransferTimeout(
                    f"P's first token did not come within {self.params.kv_timeout_s:g} s",
                    request_id=self.request_id,
                )
            )
        # _FirstTokenCame: the caller steers, which seeds position 0

    def _start_engine(self) -> None:
        req = self.request
        continued = DecodeRequest(  # (checked before any state changes)
            req.request_id,
            (*req.prompt, *self._stream),
            self._kv,
            req.block_table,
            req.max_tokens - len(self._stream),
        )
        self._run += 1
        run, prev = self._run, self._run_ended
        self._run_ended = ended = trio.Event()
        self._engine_on = True
        self._nursery.start_soon(self._run_engine, run, continued, prev, ended)

    async def _run_engine(
        self, run: int, request: DecodeRequest, prev: trio.Event | None, ended: trio.Event
    ) -> None:
        def on_token(token: int, finish: FinishReason | None) -> None:
            self._fresh.append((run, token, finish))
            if not self._woken:
                self._woken = True
                self._send_in.send_nowait(_EngineWake())

        try:
            if prev is not None:
                await prev.wait()  # one run per request at a time
            if run == self._run:  # not stopped while it waited
                await self.engine.run(request, on_token)
        finally:
            ended.set()
        self._send_in.send_nowait(_EngineEnded(run))

    def _stop_engine(self) -> None:
        if self._engine_on:
            self._engine_on = False
            self._run += 1
            self.engine.stop(self.request_id)

    async def _act(self, outs: list[Output]) -> None:
        for o in outs:
            if isinstance(o, Emit):
                final = o.position == self._finish_at
                await self.out.emit(self.request_id, o.position, o.token, final)
            elif isinstance(o, SendMessage):
                with trio.CancelScope() as self._sending:
                    try:
                        await self.link.send(o.message)
                    except PddnetError as exc:  # a lost message: the machine's timers recover
                        log.info("request %s: send failed: %s", self.request_id, exc)
                if self._sending.cancelled_caught:
                    log.info(
                        "request %s: send abandoned: the peer was reported failed", self.request_id
                    )
                self._sending = None
            elif isinstance(o, CancelTransfer):
                await self.link.cancel_transfer(self.request_id, o.reason)
            elif isinstance(o, FreeBlocks):
                self._stop_engine()
                if self._run_ended is not None:
                    # Never free blocks the engine still writes into.
                    with trio.move_on_after(self.params.recompute_timeout_s):
                        await self._run_ended.wait()
                await self.link.free_blocks(self.request_id)
            elif isinstance(o, StartRecompute):
                if o.start + len(o.tokens) >= self.request.max_tokens:
                    # nothing would be left to decode: RLD should have finished
                    overrun = RemoteProtocolError(
                        f"{o.start + len(o.tokens)} eager tokens of at most"
                        f" {self.request.max_tokens}, without a finish",
                        peer="rld",
                        request_id=self.request_id,
                    )
                    log.warning("request %s: %s", self.request_id, overrun)
                    await self._act([FreeBlocks(), Done(self.machine.state, overrun)])
                    return
                self._recompute(o.start, o.tokens)
            elif isinstance(o, TakeOver):
                pass  # may_decode turns true; _steer continues the engine
            elif isinstance(o, Done):
                self.result = o

    def _recompute(self, start: int, tokens: tuple[int, ...]) -> None:
        """(MD) continue prompt + RLD's tokens up to ``start + len(tokens)``."""
        self._stop_engine()
        if start > len(self._stream):
            raise LocalProtocolError(
                f"recompute at {start}, the stream holds {len(self._stream)} tokens",
                request_id=self.request_id,
            )
        self._kept.clear()  # a previous round's look-ahead: RLD's tokens replace it
        del self._stream[start:]
        self._finish_at = None
        self._kv = min(self._kv, len(self.request.prompt) + start)
        self._stream.extend(tokens)
        self._round_end = start + len(tokens)
        self._start_engine()

    def _holds_unowned_blocks(self) -> bool:
        """MD holds blocks for a request it never took over (RLD holds none for MD)."""
        return False


class RelayDriver(HandoffDriver):
    """Drives the RLD side of one request.

    Args:
        engine: RLD's engine.
        link: sends to MD; cancels the WAN transfer.
        out: where the user's tokens go.
        request: the request (with P's first token).
        params: handoff tuning.
    """

    def __init__(
        self,
        engine: DecodeEngine,
        link: Link,
        out: TokenOut,
        request: HandoffRequest,
        params: HandoffParams | None = None,
    ) -> None:
        params = params or HandoffParams()
        super().__init__(engine, link, out, request, params)
        self.machine: RelayHandoff = RelayHandoff(
            request.request_id, params, now=trio.current_time()
        )


class MainDriver(HandoffDriver):
    """Drives the MD side of one request.

    Args:
        engine: MD's engine.
        link: sends to RLD; cancels the WAN transfer; frees blocks.
        out: where the user's tokens go.
        request: the request (P's first token is needed on the P->MD route only).
        params: handoff tuning.
        relayed: False on the P->MD route (no RLD).
    """

    def __init__(
        self,
        engine: DecodeEngine,
        link: Link,
        out: TokenOut,
        request: HandoffRequest,
        params: HandoffParams | None = None,
        *,
        relayed: bool = True,
    ) -> None:
        params = params or HandoffParams()
        super().__init__(engine, link, out, request, params)
        self.machine: MainHandoff = MainHandoff(
            request.request_id, params, now=trio.current_time(), relayed=relayed
        )

    def kv_landed(self) -> None:
        """The WAN transfer of the prompt KV completed (never blocks)."""
        self._send_in.send_nowait(KvLanded())

    def _holds_unowned_blocks(self) -> bool:
        return self.machine.position is None
