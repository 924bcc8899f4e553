"""Redundant control paths: the sans-IO guard, and two ControlNodes on loopback.

A peer connected with ``paths=2`` gets every frame twice over two TCP
connections; the receiver must deliver each exactly once, count the second
copy as a duplicate (not as an attack), and keep working when one of the two
connections goes dead.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

import pytest
import trio
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet import LocalProtocolError
from pddnet.bench._hostile_control import raw_dealer
from pddnet.control import ControlNode
from pddnet.control._paths import K_MAX_PATHS, PathGuard, Verdict, path_identity, split_identity
from pddnet.wire import Message, Ping, Pong, encode_frame, message

KEY = "an-honest-shared-secret-0123456789"
NOW = 1_700_000_000 * 10**9


@message(15)
class Tick(Message):
    """Test-only event."""

    n: int


# -- the guard, sans IO -----------------------------------------------------------------


def test_single_path_is_a_strict_replay_guard() -> None:
    g = PathGuard(window_s=30)
    assert g.check("a", 0, NOW + 1, NOW) is Verdict.ACCEPT
    assert g.check("a", 0, NOW + 1, NOW) is Verdict.REPLAY  # same frame again
    assert g.check("a", 0, NOW, NOW) is Verdict.REPLAY  # older
    assert g.check("a", 0, NOW + 2, NOW) is Verdict.ACCEPT
    assert g.check("b", 0, NOW, NOW) is Verdict.ACCEPT  # senders are independent
    assert g.check("a", 0, NOW + 31 * 10**9, NOW) is Verdict.STALE  # outside the window
    assert g.check("a", 0, NOW - 31 * 10**9, NOW) is Verdict.STALE


def test_copies_on_two_paths_are_duplicates_and_order_across_paths_is_free() -> None:
    g = PathGuard()
    assert g.check("a", 0, NOW + 10, NOW) is Verdict.ACCEPT
    assert g.check("a", 1, NOW + 10, NOW) is Verdict.DUPLICATE
    # path 1 runs ahead; path 0 then brings an older frame that path 1 never carried
    assert g.check("a", 1, NOW + 30, NOW) is Verdict.ACCEPT
    assert g.check("a", 0, NOW + 20, NOW) is Verdict.ACCEPT
    assert g.check("a", 0, NOW + 30, NOW) is Verdict.DUPLICATE
    # a copy replayed on the path that already carried it is a replay, not a duplicate
    assert g.check("a", 1, NOW + 10, NOW) is Verdict.REPLAY
    assert g.check("a", 0, NOW + 30, NOW) is Verdict.REPLAY


def test_what_the_guard_forgot_is_never_accepted_twice() -> None:
    g = PathGuard(memory=2)
    for s in (1, 2, 3):  # seq 1 is forgotten once 3 is accepted
        assert g.check("a", 0, NOW + s, NOW) is Verdict.ACCEPT
    assert g.check("a", 1, NOW + 1, NOW) is Verdict.STALE  # cannot be proven new
    assert g.check("a", 1, NOW + 3, NOW) is Verdict.DUPLICATE  # still remembered
    # and seqs older than the time window are forgotten even below the count
    g = PathGuard(window_s=1)
    assert g.check("a", 0, NOW, NOW) is Verdict.ACCEPT
    assert g.check("a", 1, NOW + 2 * 10**9, NOW + 2 * 10**9) is Verdict.ACCEPT
    assert g.check("a", 2, NOW, NOW) is Verdict.STALE
    with pytest.raises(LocalProtocolError):
        PathGuard(memory=0)


@st.composite
def _arrivals(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    """N frames, each sent on a non-empty subset of 2 paths; a random merge of the paths."""
    n = draw(st.integers(1, 40))
    per_path: list[list[int]] = [[], []]
    for seq in range(n):
        for p in draw(st.sampled_from([(0,), (1,), (0, 1)])):
            per_path[p].append(seq)
    order = draw(st.permutations([0] * len(per_path[0]) + [1] * len(per_path[1])))
    heads = [0, 0]
    out = []
    for p in order:
        out.append((p, per_path[p][heads[p]]))
        heads[p] += 1
    return n, out


@settings(max_examples=300, deadline=None)
@given(_arrivals(), st.sampled_from([1, 3, 4096]))
def test_every_frame_is_delivered_at_most_once(
    case: tuple[int, list[tuple[int, int]]], memory: int
) -> None:
    n, arrivals = case
    g = PathGuard(memory=memory)
    accepted: list[int] = []
    for path, seq in arrivals:
        v = g.check("a", path, NOW + 1 + seq, NOW)
        assert v is not Verdict.REPLAY  # each path is in order: never a replay
        if v is Verdict.ACCEPT:
            accepted.append(seq)
    assert len(accepted) == len(set(accepted))
    if memory >= n:  # remembering everything: exactly once, nothing lost
        assert sorted(accepted) == list(range(n))


def test_identities_round_trip_and_reject_garbage() -> None:
    assert path_identity("rld", 0) == b"rld"
    assert path_identity("rld", 1) == b"rld\x00\x01"
    for k in range(K_MAX_PATHS):
        assert split_identity(path_identity("rld", k)) == ("rld", k)
    for bad in (b"rld\x00", b"rld\x00\x00", b"rld\x00\x09", b"rld\x00\x01\x01", b"\xff", b""):
        assert split_identity(bad) is None
    with pytest.raises(LocalProtocolError):
        path_identity("rld", K_MAX_PATHS)
    with pytest.raises(LocalProtocolError):
        path_identity("x" * 254, 1)
    with pytest.raises(LocalProtocolError):
        ControlNode("a\0b", secret=KEY)


# -- real sockets ---------------------------------------------------------------------


async def _until(cond: Callable[[], bool]) -> None:
    with trio.fail_after(10):
        while not cond():
            await trio.sleep(0.01)


async def test_two_paths_deliver_once_in_order_and_count_duplicates() -> None:
    async with ControlNode("a", secret=KEY) as a, ControlNode("b", secret=KEY) as b:
        got: list[tuple[str, int]] = []

        def on_tick(peer: str, msg: Tick) -> None:
            got.append((peer, msg.n))

        b.route(Tick, on_tick)
        a.route(Tick, on_tick)
        with pytest.raises(LocalProtocolError):
            await a.connect("b", b.address, paths=K_MAX_PATHS + 1)
        await a.connect("b", b.address, paths=2)
        assert await a.request("b", Ping(b"x"), timeout=5) == Pong(b"x")
        # wait until both connections carry copies (the twin connects in the background)
        while b.statistics().duplicates == 0:
            await a.request("b", Ping(), timeout=5)
        for i in range(100):
            await a.send("b", Tick(i))
        for i in range(20):
            await b.send("a", Tick(i))  # b answers on every route it heard a on
            assert await a.request("b", Ping(bytes([i])), timeout=5) == Pong(bytes([i]))
        await _until(lambda: len(got) >= 120)
        await trio.sleep(0.1)  # room for any stray second delivery
        assert [n for p, n in got if p == "a"] == list(range(100))  # once each, in order
        assert [n for p, n in got if p == "b"] == list(range(20))
        sa, sb = a.statistics(), b.statistics()
        assert sa.copies_sent >= 100 and sb.copies_sent >= 20  # both directions doubled
        assert sb.duplicates >= 100 and sa.duplicates >= 20
        for s in (sa, sb):  # copies are not attacks, and no reply came late
            assert s.rejected_replay == s.rejected_auth == s.rejected_malformed == 0
            assert s.late_replies == s.timeouts == 0
        # connecting again to the same address keeps the primary connection
        before = a._dealers["b"]
        await a.connect("b", b.address, paths=2)
        assert a._dealers["b"] is before and len(before.group) == 2
        await a.connect("b", b.address, paths=1)
        assert a._dealers["b"] is before and before.group == [before]
        assert await a.request("b", Ping(b"y"), timeout=5) == Pong(b"y")
        assert a.statistics().copies_sent == sa.copies_sent  # one path: no more copies


class _Proxy:
    """A TCP relay on loopback whose connections can be frozen (bytes stop, socket stays)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.frozen: set[int] = set()
        self.count = 0
        self.port = 0

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        index = self.count
        self.count += 1
        server = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pump, index, client, server)
            nursery.start_soon(self._pump, index, server, client)

    async def _pump(self, index: int, src: trio.SocketStream, dst: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            while True:
                data = await src.receive_some(65536)
                if not data:
                    await dst.send_eof()
                    return
                while index in self.frozen:  # a black hole: hold the bytes, close nothing
                    await trio.sleep(3600)
                await dst.send_all(data)


@pytest.fixture
async def proxied() -> AsyncIterator[tuple[ControlNode, ControlNode, _Proxy]]:
    async with (
        ControlNode("a", secret=KEY) as a,
        ControlNode("b", secret=KEY) as b,
        trio.open_nursery() as nursery,
    ):
        proxy = _Proxy(int(b.address.rsplit(":", 1)[1]))
        await nursery.start(proxy.serve)
        await a.connect("b", f"tcp://127.0.0.1:{proxy.port}", paths=2)
        await _until(lambda: proxy.count == 2)
        while b.statistics().duplicates == 0:  # both paths carry copies
            await a.request("b", Ping(), timeout=5)
        yield a, b, proxy
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("dead", [0, 1])
async def test_requests_complete_when_one_path_is_dead(
    proxied: tuple[ControlNode, ControlNode, _Proxy], dead: int
) -> None:
    a, b, proxy = proxied
    got: list[int] = []
    b.route(Tick, lambda peer, msg: got.append(msg.n))
    proxy.frozen.add(dead)  # one TCP connection now drops everything, both ways
    dup_a, dup_b = a.statistics().duplicates, b.statistics().duplicates
    for i in range(20):
        assert await a.request("b", Ping(bytes([i])), timeout=5) == Pong(bytes([i]))
        await a.send("b", Tick(i))
    await _until(lambda: len(got) == 20)
    assert got == list(range(20))
    # nothing came twice any more: the frozen connection delivered no copy
    assert a.statistics().duplicates == dup_a and b.statistics().duplicates == dup_b
    assert a.statistics().timeouts == 0


async def test_a_forged_twin_identity_is_not_learned_and_replays_are_not_delivered() -> None:
    async with ControlNode("b", secret=KEY) as b:
        got: list[int] = []
        b.route(Tick, lambda peer, msg: got.append(msg.n))
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        # bare sockets holding the key (they pass CURVE), sending hand-made frames
        socks = [
            raw_dealer(ctx, b.address, ident, key=KEY.encode())
            for ident in (b"mallory", b"mallory\x00\x01")
        ]
        try:
            forged = encode_frame(
                Tick(0), key=b"x" * 32, src="mallory", dst="b", seq=time.time_ns()
            )
            socks[1].send(forged)
            genuine = encode_frame(
                Tick(1), key=KEY.encode(), src="mallory", dst="b", seq=time.time_ns()
            )
            socks[0].send(genuine)
            await _until(lambda: got == [1] and b.statistics().rejected_auth == 1)
            assert b._twin_routes == {}  # a twin identity is learned only from genuine frames
            socks[1].send(genuine)  # the same bytes on the twin route: a copy
            socks[0].send(genuine)  # and again on its own route: a replay
            await _until(
                lambda: b.statistics().duplicates == 1 and b.statistics().rejected_replay == 1
            )
            assert got == [1]
            assert b.statistics().rejected_auth == 1
            assert b._twin_routes == {"mallory": [b"mallory\x00\x01"]}
        finally:
            for s in socks:
                s.close(0)
