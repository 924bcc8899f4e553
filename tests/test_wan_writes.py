"""The WAN sender's writes: a short write waits at once, and the WritePump wakes a
chunk's task once however often the socket fills (real loopback TCP sockets, a
slow reader so that they do fill)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import trio

from pddnet.transport.wan._io import WritePump, send_all
from pddnet.transport.wan._sockopts import K_TCP_NOTSENT_LOWAT

K_LOWAT = 32 << 10
K_PAYLOAD = 2 << 20


class _CountingSocket(socket.socket):
    """A socket that counts its ``sendmsg`` calls and those that met ``EAGAIN``."""

    calls = 0
    eagain = 0

    def sendmsg(self, *args: Any) -> int:
        self.calls += 1
        try:
            return super().sendmsg(*args)
        except BlockingIOError:
            self.eagain += 1
            raise


_Pair = tuple[socket.socket, socket.socket]


@contextmanager
def _pair(cls: type[socket.socket] = socket.socket) -> Iterator[_Pair]:
    """A connected loopback TCP pair: the writer non-blocking with a small
    ``TCP_NOTSENT_LOWAT`` and send buffer, the reader non-blocking."""
    with socket.socket() as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)
        w = cls(socket.AF_INET, socket.SOCK_STREAM)
        w.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        w.setsockopt(socket.IPPROTO_TCP, K_TCP_NOTSENT_LOWAT, K_LOWAT)
        w.connect(lsock.getsockname())
        r, _ = lsock.accept()
    r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    w.setblocking(False)
    r.setblocking(False)
    try:
        yield w, r
    finally:
        w.close()
        r.close()


async def _read_slowly(r: socket.socket, n: int, into: bytearray) -> None:
    """Read ``n`` bytes in small steps with pauses, so the writer's socket fills."""
    buf = bytearray(16 << 10)
    while len(into) < n:
        await trio.lowlevel.wait_readable(r)
        k = r.recv_into(buf)
        into += buf[:k]
        await trio.sleep(0.0005)


class _Steps(trio.abc.Instrument):
    """Counts the scheduling steps of one task."""

    def __init__(self) -> None:
        self.task: trio.lowlevel.Task | None = None
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


def _payload() -> list[memoryview]:
    data = os.urandom(K_PAYLOAD)
    # header-like head and two pieces, as a chunk is sent
    return [memoryview(data[:32]), memoryview(data[32 : 1 << 20]), memoryview(data[1 << 20 :])]


async def test_send_all_waits_after_a_short_write_instead_of_retrying() -> None:
    with _pair(_CountingSocket) as (w, r):
        bufs = _payload()
        want = b"".join(bytes(b) for b in bufs)
        got = bytearray()
        async with trio.open_nursery() as n:
            n.start_soon(_read_slowly, r, len(want), got)
            await send_all(w, bufs)
        assert bytes(got) == want
        assert isinstance(w, _CountingSocket)
        assert w.calls > 10  # the socket did fill, again and again
        # a short write means full: the old loop retried it into EAGAIN every time
        assert w.eagain <= 1


async def _steps_to_write(send: Any, *extra: Any) -> tuple[int, int]:
    """How many times the writing task was woken while ``send`` wrote a payload
    through a socket that keeps filling, and how many ``sendmsg`` calls it took."""
    steps = _Steps()
    trio.lowlevel.add_instrument(steps)
    try:
        with _pair(_CountingSocket) as (w, r):
            bufs = _payload()
            want = b"".join(bytes(b) for b in bufs)
            got = bytearray()

            async def write() -> None:
                steps.task = trio.lowlevel.current_task()
                await send(w, bufs)

            async with trio.open_nursery() as n:
                for task in extra:
                    n.start_soon(task)
                async with trio.open_nursery() as inner:
                    inner.start_soon(_read_slowly, r, len(want), got)
                    inner.start_soon(write)
                n.cancel_scope.cancel()
            assert bytes(got) == want
            assert isinstance(w, _CountingSocket)
            return steps.steps, w.calls
    finally:
        trio.lowlevel.remove_instrument(steps)


async def test_write_pump_wakes_the_sender_once_per_write() -> None:
    woken, calls = await _steps_to_write(send_all)
    assert calls > 10 and woken > 10  # send_all: one wake-up per wait for room
    pump = WritePump()
    woken, calls = await _steps_to_write(pump.send, pump.run)
    assert calls > 10  # the socket filled as often ...
    assert woken == 1  # ... and the task was woken once, when all was sent


async def test_write_pump_serves_several_sockets_and_forgets_a_cancelled_one() -> None:
    pump = WritePump()
    with _pair() as (w1, _r1), _pair() as (w2, r2):
        bufs1, bufs2 = _payload(), _payload()
        want2 = b"".join(bytes(b) for b in bufs2)
        got2 = bytearray()
        async with trio.open_nursery() as n:
            n.start_soon(pump.run)
            with trio.move_on_after(0.05) as scope:
                await pump.send(w1, bufs1)  # nobody reads r1: it stays full
            assert scope.cancelled_caught
            assert not pump._jobs  # the cancelled write is forgotten
            async with trio.open_nursery() as inner:
                inner.start_soon(_read_slowly, r2, len(want2), got2)
                inner.start_soon(pump.send, w2, bufs2)
            n.cancel_scope.cancel()
        assert bytes(got2) == want2
        assert pump._epoll.closed  # run() closes its epoll when it ends


async def test_write_pump_reports_a_broken_connection() -> None:
    pump = WritePump()
    with _pair() as (w, r):
        async with trio.open_nursery() as n:
            n.start_soon(pump.run)

            async def reset_soon() -> None:
                await trio.sleep(0.05)
                r.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                r.close()  # RST: the writer's next sendmsg fails

            n.start_soon(reset_soon)
            try:
                with trio.fail_after(5):
                    await pump.send(w, _payload())
            except OSError:
                pass
            else:
                raise AssertionError("a write into a reset connection succeeded")
            assert not pump._jobs
            n.cancel_scope.cancel()
