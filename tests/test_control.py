"""The control plane across two OS processes on tcp://127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import zmq

from pddnet import AuthError, PeerUnavailable, RemoteCallError, TransferTimeout
from pddnet.bench._hostile_control import raw_dealer
from pddnet.control import ControlNode
from pddnet.wire import FrameKind, Hello, Message, Ping, Pong, encode_frame

sys.path.insert(0, str(Path(__file__).parent))
from control_peer import Note, Report

KEY = "an-honest-shared-secret-0123456789"


@pytest.fixture
def server() -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "control_peer.py"), KEY],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def report(node: ControlNode) -> Report:
    reply = await node.request("server", Report([], 0, 0), timeout=5)
    assert isinstance(reply, Report)
    return reply


async def test_request_reply_and_events_across_processes(server: str) -> None:
    async with ControlNode("client", secret=KEY) as node:
        await node.connect("server", server)
        assert await node.request("server", Ping(b"hi"), timeout=5) == Pong(b"hi")
        for i in range(50):
            await node.send("server", Note(f"n{i}"))
        r = await report(node)
        assert r.texts == [f"client:n{i}" for i in range(50)]  # all delivered, in order
        with pytest.raises(RemoteCallError, match="no handler"):
            await node.request("server", Hello("x", 1), timeout=5)
        assert node.statistics().timeouts == 0


async def test_forged_and_replayed_frames_are_dropped(server: str) -> None:
    # A bare socket that passes the CURVE handshake (it holds the key): the
    # frame checks behind it still refuse a wrong MAC, a replay, a spoofed sender.
    raw = raw_dealer(zmq.Context.instance(), server, b"mallory", key=KEY.encode())
    try:
        async with ControlNode("client", secret=KEY) as node:
            await node.connect("server", server)
            await report(node)  # the server is up
            # 1. forged: right format, wrong key
            forged = encode_frame(
                Note("forged"), key=b"x" * 32, src="mallory", dst="server", seq=trio_ns()
            )
            raw.send(forged)
            # 2. a genuine frame, then the same bytes again: a replay
            good = encode_frame(
                Note("genuine"),
                key=KEY.encode(),
                src="mallory",
                dst="server",
                seq=trio_ns(),
                kind=FrameKind.EVENT,
            )
            raw.send(good)
            raw.send(good)
            # 3. a genuine frame claiming to be from someone else
            raw.send(
                encode_frame(
                    Note("spoof"), key=KEY.encode(), src="client", dst="server", seq=trio_ns()
                )
            )
            with trio.fail_after(5):
                while True:
                    r = await report(node)
                    if r.rejected_auth >= 2 and r.rejected_replay >= 1:
                        break
                    await trio.sleep(0.02)
            assert r.texts == ["mallory:genuine"]
            assert (r.rejected_auth, r.rejected_replay) == (2, 1)
    finally:
        raw.close(0)


def trio_ns() -> int:
    import time

    return time.time_ns()


async def test_timeouts_and_unknown_peers_are_typed() -> None:
    async with ControlNode("lonely", secret=KEY) as node:
        await node.connect("ghost", "tcp://127.0.0.1:9")  # nobody listens there
        with trio.fail_after(5), pytest.raises(TransferTimeout) as info:
            await node.request("ghost", Ping(), timeout=0.2)
        assert info.value.peer == "ghost"
        with trio.fail_after(5), pytest.raises(TransferTimeout):
            await node.send("ghost", Ping(), timeout=0.2)  # no connection: queue never drains
        with pytest.raises(PeerUnavailable):
            await node.send("never-connected", Ping())


async def test_both_directions_on_one_connection() -> None:
    async with ControlNode("a", secret=KEY) as a, ControlNode("b", secret=KEY) as b:
        got: list[str] = []

        async def on_note(peer: str, msg: Note) -> None:
            got.append(f"{peer}:{msg.text}")

        b.route(Note, on_note)
        a.route(Note, on_note)
        await b.connect("a", a.address)
        await b.send("a", Note("b->a"))
        assert await b.ping("a") >= 0
        await a.send("b", Note("a->b via router"))  # a never connected to b
        with trio.fail_after(5):
            while len(got) < 2:
                await trio.sleep(0.01)
        assert sorted(got) == ["a:a->b via router", "b:b->a"]


async def test_a_reply_that_breaks_its_schema_is_an_error_not_a_dead_node() -> None:
    async with ControlNode("a", secret=KEY) as a, ControlNode("b", secret=KEY) as b:

        def bad(peer: str, msg: Ping) -> Message:
            return Pong(payload="not bytes")  # type: ignore[arg-type]

        b.route(Ping, bad)
        await a.connect("b", b.address)
        with trio.fail_after(5), pytest.raises(RemoteCallError, match="bad reply") as info:
            await a.request("b", Ping(), timeout=2)
        assert info.value.code == "InternalError"
        b.route(Ping, lambda peer, msg: Pong(msg.payload))
        with trio.fail_after(5):
            assert await a.ping("b") >= 0  # b still serves
        assert b.statistics().handler_errors == 1


def test_missing_secret_is_an_auth_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDDNET_SECRET", raising=False)
    with pytest.raises(AuthError):
        ControlNode("x")
    with pytest.raises(AuthError):
        ControlNode("x", secret="short")
    monkeypatch.setenv("PDDNET_SECRET", KEY)
    assert ControlNode("x").name == "x"


async def test_a_node_with_another_secret_is_refused_at_the_handshake(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with (
        ControlNode("md", secret=KEY) as md,
        ControlNode("p0", secret="another-secret-0123456789abcdef") as p0,
        ControlNode("p1", secret=KEY) as p1,
    ):
        await p0.connect("md", md.address)
        await p1.connect("md", md.address)
        with pytest.raises(TransferTimeout):
            await p0.ping("md", timeout=1)
        assert await p1.ping("md", timeout=5) >= 0
        st = md.statistics()
    assert st.rejected_handshakes >= 1  # p0's connection never got to send a frame
    assert st.received == st.delivered == 1  # p1's ping, nothing from p0
    assert any("CURVE handshake failed" in r.getMessage() for r in caplog.records)
