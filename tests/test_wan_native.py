"""The WAN data path's native mover (``_mover.c``) and its trio glue in ``_io``.

Real sockets throughout. The mover is optional (pip builds it where a C
compiler is found); these tests skip without it, and the last one runs the WAN
transport's own tests on the pure-Python loop (``PDDNET_NATIVE=0``), so both
paths are covered wherever the mover is built.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time

import pytest
import trio
import xxhash

from pddnet.transport.wan import _io, native_path
from pddnet.transport.wan._acceptor import WritePermit
from pddnet.transport.wan._io import EndOfStream, LowWater, Revoked, close, recv_exact, send_all
from pddnet.transport.wan._sockopts import set_notsent_lowat
from pddnet.wire import ChecksumAlgo

_mover = pytest.importorskip("pddnet.transport.wan._mover")
pytestmark = pytest.mark.skipif(not _io.K_NATIVE, reason="PDDNET_NATIVE=0")


def _pair(rcvbuf: int | None = None) -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    for s in (a, b):
        s.setblocking(False)
    if rcvbuf is not None:
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, rcvbuf)
    return a, b


def test_native_path_is_named() -> None:
    assert native_path() == "native"


async def test_gather_write_and_exact_read_through_the_thread() -> None:
    """16 MiB in 3 pieces against a reader slower than the socket: the write and
    the read both go to the thread, and the bytes come out whole and in order."""
    a, b = _pair(rcvbuf=64 << 10)
    pieces = [os.urandom(1 << 20), b"", os.urandom(15 << 20)]
    want = b"".join(pieces)
    got = bytearray(len(want))
    lowat = LowWater(b)
    async with trio.open_nursery() as n:
        n.start_soon(send_all, a, [memoryview(p) for p in pieces])
        with trio.fail_after(20):
            for lo in range(0, len(want), 1 << 20):
                await recv_exact(b, memoryview(got)[lo : lo + (1 << 20)], lowat)
    assert got == want
    # the mover set the receive low-water mark for what was still wanted (the
    # kernel clamps it to half the small buffer), and LowWater follows what it
    # asked for, so the pure-Python loop's set() stays right afterwards
    assert lowat.value > 1
    a.close()
    b.close()


async def test_end_of_stream_and_errors_are_reported() -> None:
    a, b = _pair()
    a.send(b"abc")
    a.close()
    with pytest.raises(EndOfStream):
        await recv_exact(b, memoryview(bytearray(10)), LowWater(b))
    b.close()
    # a write into a connection the peer reset
    a, b = _pair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    b.close()  # RST
    await trio.sleep(0.05)
    with pytest.raises(OSError):
        for _ in range(100):
            await send_all(a, [memoryview(bytes(1 << 20))])
    a.close()


async def test_revoked_permit_stops_the_read_with_no_byte_more() -> None:
    """A read waiting on the thread is taken back when its permit is revoked: the
    task gets Revoked with the bytes that had landed, and data that arrives later
    is not written into the buffer (a receiver's blocks may be someone else's)."""
    a, b = _pair()
    buf = bytearray(1 << 20)
    permit = WritePermit()
    a.send(b"x" * 1000)
    await trio.sleep(0.05)
    got: list[BaseException] = []

    async def read() -> None:
        try:
            await recv_exact(b, memoryview(buf), LowWater(b), permit)
        except Revoked as exc:
            got.append(exc)

    async with trio.open_nursery() as n:
        n.start_soon(read)
        await trio.sleep(0.05)
        permit.revoke()
    assert len(got) == 1 and isinstance(got[0], Revoked) and got[0].got == 1000
    a.send(b"y" * 50_000)
    await trio.sleep(0.1)
    assert buf[:1000] == b"x" * 1000 and buf[1000:] == bytes(len(buf) - 1000)
    # the unread bytes are still queued on the socket, for whoever reads next
    assert b.recv(1 << 20) == b"y" * 50_000
    a.close()
    b.close()


async def test_cancelled_read_is_taken_back() -> None:
    a, b = _pair()
    buf = bytearray(1 << 16)
    with trio.move_on_after(0.05):
        await recv_exact(b, memoryview(buf), LowWater(b))
    a.send(b"z" * 1000)
    await trio.sleep(0.05)
    assert buf == bytes(len(buf))
    assert b.recv(4096) == b"z" * 1000
    a.close()
    b.close()


async def test_close_wakes_a_waiting_read_and_write() -> None:
    """``_io.close`` takes the socket's operations back before closing it, and their
    tasks get ClosedResourceError (as trio's own waits do), not a hang."""
    a, _ = pair_a = _pair(rcvbuf=64 << 10)  # a writes into a peer that does not read
    _, b = pair_b = _pair()  # b reads from a peer that does not write
    errors: list[BaseException] = []

    async def run(fn: object, *args: object) -> None:
        try:
            await fn(*args)  # type: ignore[operator]
        except trio.ClosedResourceError as exc:
            errors.append(exc)

    with trio.fail_after(5):
        async with trio.open_nursery() as n:
            n.start_soon(run, recv_exact, b, memoryview(bytearray(100)), LowWater(b))
            n.start_soon(run, send_all, a, [memoryview(bytes(64 << 20))])
            await trio.sleep(0.1)
            close(a)
            close(b)
    assert len(errors) == 2
    pair_a[1].close()
    pair_b[0].close()


async def test_a_read_and_a_write_wait_on_one_socket_together() -> None:
    """A receiver's connection task waits in a read while another task's frame
    waits for room on the same socket: both complete (epoll registers the
    socket once, so the second registers a duplicate descriptor)."""
    a, b = _pair(rcvbuf=64 << 10)
    out = os.urandom(8 << 20)  # far more than the socket buffers take
    got = bytearray(1000)
    back = bytearray(len(out))
    async with trio.open_nursery() as n:
        n.start_soon(recv_exact, b, memoryview(got), LowWater(b))
        await trio.sleep(0.05)  # the read waits on the thread
        n.start_soon(send_all, b, [memoryview(out)])
        await trio.sleep(0.05)  # so does the write: a does not read yet
        a.setblocking(True)
        await trio.to_thread.run_sync(a.sendall, b"r" * 1000)
        with trio.fail_after(10):
            lo = 0
            while lo < len(out):
                lo += await trio.to_thread.run_sync(a.recv_into, memoryview(back)[lo:])
    assert got == b"r" * 1000 and back == out
    a.close()
    b.close()


def _writable(sock: socket.socket) -> bool:
    p = select.poll()
    p.register(sock, select.POLLOUT)
    return bool(p.poll(0))


async def test_a_send_with_room_ends_once_the_socket_has_room_again() -> None:
    """``room=True``: the send ends only when every byte is written *and* the socket
    is writable again; a plain send ends with the bytes queued. A TCP socket with
    an unsent mark M takes writes while under M unsent bytes but is writable
    only under M / 2, so 1.5 MiB written into a peer that does not read (its
    window takes at most a few hundred KiB) leaves it between the two."""
    with socket.socket() as srv:  # b's buffer small from the handshake on
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    for x in (a, b):
        x.setblocking(False)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    set_notsent_lowat(a, 2 << 20)
    data = os.urandom(3 << 19)
    lowat = LowWater(b)
    for room in (False, True):
        got = bytearray(len(data))
        ended = trio.Event()

        async def send(room: bool = room, ended: trio.Event = ended) -> None:
            await send_all(a, [memoryview(data)], room=room)
            ended.set()

        async with trio.open_nursery() as n:
            n.start_soon(send)
            with trio.fail_after(10):
                if not room:
                    await ended.wait()  # every byte taken, most of it unsent
                else:
                    await trio.sleep(0.3)
                    assert not ended.is_set()
                assert not _writable(a)
                await recv_exact(b, memoryview(got), lowat)
                await ended.wait()
        assert got == data and _writable(a)
    a.close()
    b.close()


def test_mover_rules() -> None:
    """The mover's own API: a reserved token, a closed mover, cancel of what is not
    active, and a completion delivered through its eventfd."""
    m = _mover.Mover()
    a, b = _pair()
    with pytest.raises(ValueError):
        m.send(a.fileno(), [b"x"], 0)
    assert m.cancel(12345) is None
    assert m.send(a.fileno(), [b"hello", b" ", b"world"], 1) == (_mover.DONE, 11, 0)
    buf = bytearray(20)
    status, done, _ = m.recv(b.fileno(), buf, 2, 1, 1 << 18)
    assert (status, done) == (_mover.PENDING, 11)
    a.send(b"123456789")
    deadline = time.monotonic() + 5
    comps: list[tuple[int, int, int, int]] = []
    while not comps and time.monotonic() < deadline:
        comps = m.completions()
        time.sleep(0.01)
    assert comps and comps[0][:3] == (2, _mover.DONE, 20)
    assert bytes(buf) == b"hello world123456789"
    status, _, _ = m.recv(b.fileno(), bytearray(4), 3, 1, 1 << 18)
    assert status == _mover.PENDING
    assert m.cancel_fd(b.fileno()) == [3]
    m.close()
    m.close()
    with pytest.raises(ValueError):
        m.send(a.fileno(), [b"x"], 4)
    a.close()
    b.close()


async def test_digest_follows_the_bytes_through_the_thread() -> None:
    """A receive's XXH3 digest is updated on the thread as the bytes are read (in
    pieces, across calls), and equals python-xxhash's of the whole."""
    assert _io.K_NATIVE_XXH3
    a, b = _pair(rcvbuf=64 << 10)
    want = os.urandom(6 << 20)
    got = bytearray(len(want))
    digest = _io.Digest(ChecksumAlgo.XXH3_64)
    assert digest.native is not None
    lowat = LowWater(b)
    async with trio.open_nursery() as n:
        n.start_soon(send_all, a, [memoryview(want)])
        with trio.fail_after(20):
            for lo, hi in ((0, 1), (1, 3 << 20), (3 << 20, len(want))):
                await recv_exact(b, memoryview(got)[lo:hi], lowat, None, digest)
    assert got == want
    assert digest.value() == xxhash.xxh3_64_intdigest(want)
    a.close()
    b.close()


def test_a_digest_in_use_is_refused() -> None:
    m = _mover.Mover()
    a, b = _pair()
    h = _mover.Xxh3()
    assert m.recv(b.fileno(), bytearray(10), 1, 1, 1 << 18, h)[0] == _mover.PENDING
    with pytest.raises(RuntimeError):
        h.update(b"x")
    with pytest.raises(RuntimeError):
        m.recv(a.fileno(), bytearray(10), 2, 1, 1 << 18, h)
    m.cancel(1)
    h.update(b"x")
    assert h.intdigest() == xxhash.xxh3_64_intdigest(b"x")
    m.close()
    a.close()
    b.close()


def test_a_forked_child_drops_the_parents_mover() -> None:
    """A child forked while a Mover runs has no thread of it: the inherited Mover
    refuses work and closes without waiting for the parent's thread, and a new
    Mover works there."""
    m = _mover.Mover()
    _, b = held = _pair()
    a2, b2 = _pair()
    m.recv(b.fileno(), bytearray(10), 1, 1, 1 << 18)
    pid = os.fork()
    if pid == 0:  # the child: any failure is its exit status
        code = 1
        try:
            try:
                m.send(a2.fileno(), [b"x"], 2)
            except ValueError:
                m.close()
                fresh = _mover.Mover()
                assert fresh.send(a2.fileno(), [b"ok"], 1)[0] == _mover.DONE
                fresh.close()
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    time.sleep(0.05)
    assert b2.recv(10) == b"ok"
    assert m.cancel(1) is not None  # the parent's operation is still its own
    m.close()
    for s in (*held, a2, b2):
        s.close()


def test_buffers_are_held_while_the_thread_uses_them() -> None:
    """A buffer under a pending operation cannot be resized or released away
    from under the thread (the mover holds a buffer export until it is done)."""
    m = _mover.Mover()
    a, b = _pair()
    buf = bytearray(100)
    m.recv(b.fileno(), buf, 1, 1, 1 << 18)
    with pytest.raises(BufferError):
        buf.extend(b"more")
    m.cancel(1)
    buf.extend(b"more")  # released by cancel
    m.close()
    a.close()
    b.close()


def test_many_threads_of_traffic_do_not_mix_up_operations() -> None:
    """Eight sockets, each with its own operation in flight on the one thread, plus
    cancels from the caller: every completion belongs to its own token and buffer."""
    m = _mover.Mover()
    pairs = [_pair(rcvbuf=32 << 10) for _ in range(8)]
    bufs = [bytearray(1 << 20) for _ in pairs]
    data = [os.urandom(1 << 20) for _ in pairs]
    for i, (_, b) in enumerate(pairs):
        assert m.recv(b.fileno(), bufs[i], i + 1, 1, 1 << 18)[0] == _mover.PENDING

    def write(i: int) -> None:
        s = pairs[i][0]
        s.setblocking(True)
        s.sendall(data[i])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    done: dict[int, int] = {}
    deadline = time.monotonic() + 20
    while len(done) < 8 and time.monotonic() < deadline:
        for token, status, n, _ in m.completions():
            assert status == _mover.DONE
            done[token] = n
        time.sleep(0.005)
    for t in threads:
        t.join()
    assert done == {i + 1: 1 << 20 for i in range(8)}
    assert all(bytes(bufs[i]) == data[i] for i in range(8))
    m.close()
    for a, b in pairs:
        a.close()
        b.close()


@pytest.mark.slow
def test_wan_transport_tests_pass_on_the_pure_python_loop() -> None:
    """The fallback stays tested: the WAN transport's tests with PDDNET_NATIVE=0."""
    env = dict(os.environ, PDDNET_NATIVE="0")
    probe = "from pddnet.transport.wan import native_path; print(native_path())"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "python", out
    here = os.path.dirname(__file__)
    files = ["test_transport_wan.py", "test_transport_wan_revoke.py", "test_wan_trailer.py"]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
        + [os.path.join(here, f) for f in files],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout, r.stdout[-2000:]
