"""ControlNode.disconnect over real sockets: the TCP connections to the peer
close, the sockets' descriptors and reader tasks go, and the peer is reachable
again only through a connection of its own or a new connect()."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import pytest
import trio

from pddnet import PeerUnavailable
from pddnet.control import ControlNode
from pddnet.wire import Ping, Pong

KEY = "a-control-disconnect-test-secret-012345"


def _established_to(port: int) -> int:
    """TCP connections in ESTABLISHED state whose remote end is 127.0.0.1:port."""
    n = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            remote, state = fields[2], fields[3]
            if state == "01" and remote == f"0100007F:{port:04X}":
                n += 1
    return n


def _fds() -> set[tuple[str, str]]:
    """This process's descriptors, each with what it points at."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own, another thread's)
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
    return out


async def _until(cond: Callable[[], bool], what: str) -> None:
    with trio.move_on_after(5):
        while not cond():
            await trio.sleep(0.01)
    assert cond(), f"not within 5 s: {what}"


async def test_disconnect_closes_the_connections_and_releases_their_resources() -> None:
    async with ControlNode("a", secret=KEY) as a, ControlNode("b", secret=KEY) as b:
        port = int(b.address.rsplit(":", 1)[1])
        nursery = a._nursery
        assert nursery is not None
        tasks, before = len(nursery.child_tasks), _fds()
        await a.connect("b", b.address, paths=2)  # a primary DEALER and a twin
        assert await a.request("b", Ping(b"x"), timeout=5) == Pong(b"x")
        assert a.peers() == {"b"} and _established_to(port) == 2
        assert len(nursery.child_tasks) == tasks + 2  # one reader per socket
        # The descriptors the connections opened (not a count of the process's:
        # in a full run, other tests' leftovers close and open beside this one)
        opened = _fds() - before
        assert opened, "connect opened no descriptor"

        a.disconnect("b")
        assert a.peers() == set()
        await _until(lambda: _established_to(port) == 0, "both connections closed")
        await _until(lambda: len(nursery.child_tasks) == tasks, "the readers ended")
        await _until(lambda: not opened & _fds(), "the sockets' descriptors released")
        # b never connected to a: no route is left either way
        with pytest.raises(PeerUnavailable):
            await a.request("b", Ping(b"y"), timeout=5)
        a.disconnect("b")  # again: ignored
        # a new connect opens fresh connections that work
        await a.connect("b", b.address)
        assert await a.request("b", Ping(b"z"), timeout=5) == Pong(b"z")
        assert _established_to(port) == 1


async def test_after_disconnect_a_peer_that_connected_to_us_is_still_answered() -> None:
    """Only our own connections close: b's connection to a (a's ROUTER route)
    stays, so a still reaches b over it."""
    async with ControlNode("a", secret=KEY) as a, ControlNode("b", secret=KEY) as b:
        await a.connect("b", b.address)
        await b.connect("a", a.address)
        assert await b.request("a", Ping(b"1"), timeout=5) == Pong(b"1")  # a heard b
        a.disconnect("b")
        assert await a.request("b", Ping(b"2"), timeout=5) == Pong(b"2")
