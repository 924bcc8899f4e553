"""The user's end of a request: :class:`TokenSink` and its :class:`TokenStream` s.

Decoders send each token of the user's stream to the request's *sink* node as
a one-way ``Emitted`` frame. A sink built on :class:`TokenSink` turns those
frames into a stream that is complete and in order or ends with a typed
error, never silently short: the sans-IO :class:`~pddnet.api._stream.StreamAssembler`
finds holes and silences, and the sink asks the decoders to re-send
(``StreamResend`` / ``StreamStatus``). See docs/reliability.md.

Usage, on P's node (:attr:`PrefillEndpoint.sink`) or any other node::

    stream = p.sink.open(rid, deadline_s=30)
    await p.submit(rid, prompt, blocks, first, max_tokens, sink=p.name)
    async for tok in stream:  # StreamToken(position, token, source, time)
        ...
    # or: tokens = await stream.result()

Open the stream before submitting, so that no token arrives unclaimed.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import trio

from .._errors import LocalProtocolError, PddnetError, ResourceLimitError
from ..control import ControlNode
from ..wire import encode_tokens
from ._messages import Abort, Emitted, StreamAck, StreamResend, StreamStatus, StreamTakeover
from ._stream import SourceState, StreamAssembler, StreamPhase, StreamReport

__all__ = ["SinkStatistics", "StreamToken", "TokenSink", "TokenStream"]

log = logging.getLogger("pddnet.api")

K_MAX_OPEN_STREAMS = 1 << 16


@dataclass(frozen=True, slots=True)
class StreamToken:
    """One token of a stream: ``time`` is ``trio.current_time()`` at delivery."""

    position: int
    token: int
    source: str
    time: float


@dataclass(frozen=True, slots=True)
class SinkStatistics:
    opened: int
    finished: int
    failed: int
    open: int
    tokens: int
    duplicates: int
    rounds: int
    unclaimed_frames: int
    takeovers: int = 0  # StreamTakeover reports sent to MD (RLD lost mid-stream)


class TokenStream:
    """One request's token stream; made by :meth:`TokenSink.open`."""

    def __init__(self, sink: TokenSink, assembler: StreamAssembler) -> None:
        self._sink = sink
        self._asm = assembler
        self.request_id = assembler.request_id
        self.received: list[StreamToken] = []
        self._changed = trio.Event()

    @property
    def done(self) -> bool:
        return self._asm.phase is not StreamPhase.OPEN

    @property
    def error(self) -> PddnetError | None:
        return self._asm.error

    @property
    def tokens(self) -> list[int]:
        """The tokens delivered so far, in order (position i is ``tokens[i]``)."""
        return list(self._asm.delivered)

    @property
    def sources(self) -> list[str]:
        return list(self._asm.sources)

    def watch(self, *sources: str, relay: str = "", main: str = "") -> None:
        """Name decoders that serve the request (RLD, MD), so that the sink can
        ask them for lost tokens before any token of theirs arrived.

        Args:
            sources: the decoders.
            relay, main: on the P->RLD->MD route, which one is RLD and which MD:
                if RLD then stops answering while MD waits for its handover,
                the sink tells MD to take over (``StreamTakeover``).
        """
        self._asm.add_sources(sources)
        self._asm.set_handoff(relay, main)
        self._sink._kick(self)

    def close(self, reason: str = "closed by the sink") -> None:
        """Give up on the stream; its decoders are told to stop (``Abort``)."""
        self._asm.close(reason)
        self._sink._kick(self)

    async def __aiter__(self) -> AsyncIterator[StreamToken]:
        """The tokens in order; raises the stream's typed error where it stops."""
        i = 0
        while True:
            while i < len(self.received):
                yield self.received[i]
                i += 1
            if self.done:
                if self.error is not None:
                    raise self.error
                return
            await self._changed.wait()

    async def result(self) -> list[int]:
        """Wait for the whole stream.

        Raises:
            RequestAborted: a decoder aborted the request.
            PeerUnavailable: no decoder can deliver the rest (it died).
            TransferTimeout: the deadline passed first.
            RemoteProtocolError: a decoder sent a malformed stream.
        """
        async for _ in self:
            pass
        return self.tokens

    def _deliver(self, items: list[tuple[int, int, str]], now: float) -> None:
        for pos, tok, src in items:
            self.received.append(StreamToken(pos, tok, src, now))
        self._changed.set()
        self._changed = trio.Event()


class TokenSink:
    """Receives token streams on ``node``; an async context manager.

    Args:
        node: the sink's control node (the name decoders are given as ``sink``).
        gap_delay_s: how long a hole may stay open before the sink asks for it.
        poll_interval_s: silence before the sink asks the decoders how the
            request is doing, and the spacing of such rounds.
        max_failed_rounds: rounds in a row in which no decoder could deliver
            the stream before it fails with :class:`~pddnet.PeerUnavailable`.
        route: route ``Emitted`` and ``Abort`` on ``node`` (False when an
            endpoint on the same node forwards them, as
            :class:`PrefillEndpoint` does).
        max_streams: open streams at most (:meth:`open` raises
            :class:`~pddnet.ResourceLimitError` past it).
    """

    def __init__(
        self,
        node: ControlNode,
        *,
        gap_delay_s: float = 0.05,
        poll_interval_s: float = 1.0,
        max_failed_rounds: int = 3,
        route: bool = True,
        max_streams: int = K_MAX_OPEN_STREAMS,
    ) -> None:
        self.node = node
        self.gap_delay_s = gap_delay_s
        self.poll_interval_s = poll_interval_s
        self.max_failed_rounds = max_failed_rounds
        self.max_streams = max_streams
        self._streams: dict[int, TokenStream] = {}
        self._wake: dict[int, tuple[trio.Event, float]] = {}  # the task's event and timer
        self._nursery: trio.Nursery | None = None
        self._cm: Any = None
        self._stats = dict.fromkeys(SinkStatistics.__dataclass_fields__, 0)
        if route:
            node.route(Emitted, self.on_emitted)
            node.route(Abort, self.on_abort)

    async def __aenter__(self) -> TokenSink:
        self._cm = trio.open_nursery()
        self._nursery = await self._cm.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        self._nursery = None
        return bool(await self._cm.__aexit__(*exc))

    def open(
        self,
        request_id: int,
        *,
        deadline_s: float | None = None,
        max_tokens: int = 1 << 20,
        sources: tuple[str, ...] = (),
    ) -> TokenStream:
        """Start receiving ``request_id``'s stream.

        Args:
            deadline_s: seconds from now by which the stream must end; it
                fails with :class:`~pddnet.TransferTimeout` after (None: no
                deadline; the failed-round rule still ends it if its decoders die).
            max_tokens: the request's output limit (larger positions are errors).
            sources: decoders known to serve it (see :meth:`TokenStream.watch`).

        Raises:
            LocalProtocolError: the sink is not running, the id is open already.
            ResourceLimitError: too many open streams.
        """
        if self._nursery is None:
            raise LocalProtocolError("the sink is not running (use `async with`)")
        if request_id in self._streams:
            raise LocalProtocolError("stream already open", request_id=request_id)
        if len(self._streams) >= self.max_streams:
            raise ResourceLimitError(
                f"{len(self._streams)} open streams (max_streams={self.max_streams})",
                request_id=request_id,
            )
        now = trio.current_time()
        asm = StreamAssembler(
            request_id,
            now,
            deadline=now + deadline_s if deadline_s else math.inf,
            max_tokens=max_tokens,
            gap_delay_s=self.gap_delay_s,
            poll_interval_s=self.poll_interval_s,
            max_failed_rounds=self.max_failed_rounds,
        )
        asm.add_sources(sources)
        stream = TokenStream(self, asm)
        self._streams[request_id] = stream
        self._wake[request_id] = (trio.Event(), math.inf)
        self._stats["opened"] += 1
        self._nursery.start_soon(self._run, stream)
        return stream

    def stream(self, request_id: int) -> TokenStream | None:
        """The open stream of ``request_id``, if any."""
        return self._streams.get(request_id)

    def statistics(self) -> SinkStatistics:
        return SinkStatistics(**{**self._stats, "open": len(self._streams)})

    # --------------------------------------------------------------- frames
    def on_emitted(self, peer: str, msg: Emitted) -> None:
        """``Emitted`` handler (route it here, or call it from yours)."""
        stream = self._streams.get(msg.request_id)
        if stream is None:
            self._stats["unclaimed_frames"] += 1
            return
        asm = stream._asm
        dups = asm.duplicates
        now = trio.current_time()
        out = asm.receive(msg.position, msg.token, msg.finished, peer, now)
        self._stats["duplicates"] += asm.duplicates - dups
        self._stats["tokens"] += len(out)
        if out:
            stream._deliver(out, now)
        self._kick(stream)

    def on_abort(self, peer: str, msg: Abort) -> None:
        """``Abort`` handler (route it here, or call it from yours)."""
        stream = self._streams.get(msg.request_id)
        if stream is not None:
            stream._asm.abort(msg.reason, peer)
            self._kick(stream)

    # -------------------------------------------------------------- driving
    def _kick(self, stream: TokenStream) -> None:
        # Wake the stream's task only if it must act sooner than it planned:
        # a later timer is found when it wakes, so most tokens cost no switch.
        entry = self._wake.get(stream.request_id)
        asm = stream._asm
        if entry is not None and (asm.phase is not StreamPhase.OPEN or asm.next_timer() < entry[1]):
            entry[0].set()

    async def _run(self, stream: TokenStream) -> None:
        """The stream's timers and rounds, until it ends."""
        asm, rid = stream._asm, stream.request_id
        try:
            while asm.phase is StreamPhase.OPEN:
                wake, until = trio.Event(), asm.next_timer()
                self._wake[rid] = (wake, until)
                with trio.move_on_at(until):
                    await wake.wait()
                if asm.poll(trio.current_time()):
                    self._stats["rounds"] += 1
                    asm.round_result(await self._round(asm), trio.current_time())
                    move = asm.takeover()
                    if move is not None:
                        await self._takeover(asm, *move)
        finally:
            if asm.phase is StreamPhase.OPEN:  # the sink is closing: so does the stream
                asm.close("the token sink closed")
            self._streams.pop(rid, None)
            self._wake.pop(rid, None)
            stream._changed.set()
        if asm.phase is StreamPhase.FINISHED:
            self._stats["finished"] += 1
            for src in asm.sources:
                await self._tell(src, StreamAck(rid))
        else:
            self._stats["failed"] += 1
            reason = f"sink gave up: {asm.error}"
            for src in asm.sources:
                await self._tell(src, Abort(rid, reason))

    async def _round(self, asm: StreamAssembler) -> dict[str, StreamReport | None]:
        """Ask every known decoder to re-send from the first missing position."""
        reports: dict[str, StreamReport | None] = dict.fromkeys(asm.sources)
        timeout = self.poll_interval_s

        async def ask(src: str) -> None:
            try:
                reply = await self.node.request(
                    src, StreamResend(asm.request_id, asm.next), timeout=timeout
                )
            except PddnetError:
                return
            if isinstance(reply, StreamStatus) and reply.request_id == asm.request_id:
                try:
                    state = SourceState(reply.state)
                except ValueError:
                    return
                reports[src] = StreamReport(state, reply.first, reply.last, reply.detail)

        async with trio.open_nursery() as nursery:
            for src in asm.sources:
                nursery.start_soon(ask, src)
        return reports

    async def _takeover(self, asm: StreamAssembler, main: str, position: int) -> None:
        """Tell MD that RLD is gone and where the user's stream stands. MD answers
        at once (it confirms RLD's death and takes over in the background);
        its tokens then arrive like any others. A refusal changes nothing."""
        self._stats["takeovers"] += 1
        try:
            tokens = encode_tokens(asm.delivered[:position])
            msg = StreamTakeover(asm.request_id, position, tokens)
            await self.node.request(main, msg, timeout=self.poll_interval_s)
        except (PddnetError, ValueError) as exc:  # ValueError: a token id out of range
            log.info("takeover report for %s to %s failed: %s", asm.request_id, main, exc)

    async def _tell(self, peer: str, msg: Any) -> None:
        with contextlib.suppress(PddnetError):  # best effort: the decoders' timers end it anyway
            await self.node.send(peer, msg, timeout=1.0)
