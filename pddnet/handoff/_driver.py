"""Trio drivers: connect the handoff machines to an engine and a message link.

A driver owns one machine for one request. One task feeds it events, in
order, from a single inbox (messages from the peer, engine results, KV
landing, failure reports) and acts on its outputs; engine calls (a decode
step, an extend) run as separate tasks that post their results to the same
inbox, so the machine never sees two events at once and never waits on the
engine. Between events the driver sleeps until ``machine.get_timer()`` and
then feeds :class:`Timer`, so every wait inherits the machine's deadlines.

A decode step may finish after the machine stopped accepting tokens (RLD
sent its final batch while the step ran). The driver holds that token instead
of dropping it: should RLD resume (MD refused or died before emitting), the
held token is the one at the resume position and is fed first, so the engine
never has to rewind.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Protocol

import trio

from .._errors import PddnetError, RemoteProtocolError
from ..wire import Message
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
from ._messages import event_for_message
from ._params import HandoffParams
from ._relay import RelayHandoff

__all__ = ["DecodeEngine", "ExtendEngine", "HandoffDriver", "Link", "MainDriver", "RelayDriver"]

log = logging.getLogger("pddnet.handoff")
# Peer messages queued for one request at most; a well-behaved peer has a
# handful in flight (a batch, an ack, a retransmission).
K_MAX_PEER_BACKLOG = 256


class DecodeEngine(Protocol):
    """The engine hooks a decode instance offers (RLD and MD)."""

    async def decode_step(self, request_id: int) -> tuple[int, FinishReason | None]:
        """Run one decode step; return the token and, if it ends the request, why."""
        ...

    async def emit(self, request_id: int, position: int, token: int) -> None:
        """Deliver ``token`` at ``position`` of the user's stream."""
        ...


class ExtendEngine(DecodeEngine, Protocol):
    """MD's extra hook: recompute the KV of eager tokens in one pass."""

    async def extend(self, request_id: int, start: int, tokens: Sequence[int]) -> None:
        """Compute KV for ``tokens`` at positions ``start..``; keep the last logits."""
        ...


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

    def __init__(self, engine: DecodeEngine, link: Link, request_id: int) -> None:
        self.engine = engine
        self.link = link
        self.request_id = request_id
        self._send_in, self._inbox = trio.open_memory_channel[Event](math.inf)
        self._from_peer: set[int] = set()  # ids of queued events that came from the peer
        self.dropped = 0  # peer messages dropped because too many were queued
        self._stepping = False
        self._held: TokenGenerated | None = None
        self._extending: trio.Event | None = None
        self._sending: trio.CancelScope | None = None  # around a send to the peer in progress
        self.result: Done | None = None

    # ----------------------------------------------------- inputs, thread-free
    def deliver(self, message: Message) -> None:
        """Hand the driver a message from the peer (never blocks).

        A malformed message is logged and dropped: the peer's retransmissions
        or the machine's deadlines recover.
        """
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
            LocalProtocolError: if the machine rejects an event (a bug in the
                engine hooks). A misbehaving peer (RemoteProtocolError) fails
                the request instead: ``Done(ERROR, error)``, blocks freed.

        Cancellation: engine tasks still running are cancelled; the machine is
        left in its current state and nothing is freed. Feed :meth:`cancel`
        and let ``run`` return instead, to release resources cleanly.
        """
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._maybe_step()
            while self.result is None:
                deadline = self.machine.get_timer()
                ev: Event = Timer()
                # Queued events first: a timer that passed while we acted (a send
                # that waited) must not starve them, a failure report above all.
                try:
                    ev = self._inbox.receive_nowait()
                except trio.WouldBlock:
                    with trio.move_on_at(deadline if deadline is not None else math.inf):
                        ev = await self._inbox.receive()
                else:
                    await trio.lowlevel.checkpoint()
                self._from_peer.discard(id(ev))
                await self._feed(ev)
            nursery.cancel_scope.cancel()
        return self.result

    async def _feed(self, ev: Event) -> None:
        if isinstance(ev, TokenGenerated):
            self._stepping = False
            if not self.machine.may_decode:
                self._held = ev  # generated during a switch; replayed on resume
                return
        try:
            outs = self.machine.handle(ev, trio.current_time())
        except RemoteProtocolError as exc:
            # The peer broke the protocol: fail this request, keep the process.
            log.warning("request %s: %s", self.request_id, exc)
            outs = [FreeBlocks()] if self._owns_blocks_unowned() else []
            outs.append(Done(self.machine.state, exc))
        await self._act(outs)
        if self._held is not None and self.machine.may_decode and not self.machine.done:
            held, self._held = self._held, None
            await self._feed(held)
            return
        self._maybe_step()

    async def _act(self, outs: list[Output]) -> None:
        for o in outs:
            if isinstance(o, Emit):
                await self.engine.emit(self.request_id, o.position, o.token)
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
                if self._extending is not None:
                    # Never free blocks an extend is still writing into.
                    with trio.move_on_after(self._free_wait_s()):
                        await self._extending.wait()
                await self.link.free_blocks(self.request_id)
            elif isinstance(o, StartRecompute):
                self._nursery.start_soon(self._extend, o.start, o.tokens)
            elif isinstance(o, TakeOver):
                pass  # may_decode turns true; _maybe_step starts decoding
            elif isinstance(o, Done):
                self.result = o

    def _maybe_step(self) -> None:
        if (
            self.result is None
            and not self._stepping
            and self._held is None
            and self.machine.may_decode
        ):
            self._stepping = True
            self._nursery.start_soon(self._step)

    async def _step(self) -> None:
        token, finish = await self.engine.decode_step(self.request_id)
        self._send_in.send_nowait(TokenGenerated(token, finish))

    async def _extend(self, start: int, tokens: tuple[int, ...]) -> None:
        engine = self.engine
        assert hasattr(engine, "extend")
        self._extending = done = trio.Event()
        try:
            await engine.extend(self.request_id, start, tokens)
        finally:
            done.set()
            self._extending = None
        self._send_in.send_nowait(RecomputeDone(start + len(tokens)))

    def _owns_blocks_unowned(self) -> bool:
        """MD holds blocks for a request it never took over."""
        m = self.machine
        return isinstance(m, MainHandoff) and m.position is None

    def _free_wait_s(self) -> float:
        params = getattr(self.machine, "params", None)
        return params.recompute_timeout_s if params is not None else 5.0


class RelayDriver(HandoffDriver):
    """Drives the RLD side of one request.

    Args:
        engine: RLD's decode and emit hooks.
        link: sends to MD; cancels the WAN transfer.
        request_id: the request.
        params: handoff tuning.
    """

    def __init__(
        self, engine: DecodeEngine, link: Link, request_id: int, params: HandoffParams | None = None
    ) -> None:
        super().__init__(engine, link, request_id)
        self.machine: RelayHandoff = RelayHandoff(request_id, params, now=trio.current_time())


class MainDriver(HandoffDriver):
    """Drives the MD side of one request.

    Args:
        engine: MD's extend, decode and emit hooks.
        link: sends to RLD; cancels the WAN transfer; frees blocks.
        request_id: the request.
        params: handoff tuning.
        relayed: False on the P->MD route (no RLD).
    """

    def __init__(
        self,
        engine: ExtendEngine,
        link: Link,
        request_id: int,
        params: HandoffParams | None = None,
        *,
        relayed: bool = True,
    ) -> None:
        super().__init__(engine, link, request_id)
        self.machine: MainHandoff = MainHandoff(
            request_id, params, now=trio.current_time(), relayed=relayed
        )

    def kv_landed(self) -> None:
        """The WAN transfer of the prompt KV completed (never blocks)."""
        self._send_in.send_nowait(KvLanded())
