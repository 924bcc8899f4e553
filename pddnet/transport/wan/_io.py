"""Socket helpers of the WAN transport: non-blocking stdlib sockets driven by trio.

The hot loops use plain non-blocking sockets and wait with
``trio.lowlevel.wait_readable`` / ``wait_writable`` only when the kernel says
``EAGAIN`` (``recv_exact`` also right after a short read, which took all that
was queued). A ``trio.socket`` call yields to the scheduler on *every* call,
even when data is ready; on a 1 MiB chunk that is dozens of extra scheduler
passes per chunk, which halved loopback goodput in measurement (docs/wan.md).
Each helper still checkpoints once per call, as trio requires.

The same helpers drive TLS sockets (``ssl.SSLSocket``, see :mod:`._tls`):
``recv_into`` then decrypts straight into the destination, ``SSLWantRead``/
``SSLWantWrite`` take the place of ``EAGAIN``, and, as ``SSLSocket`` has no
``sendmsg``, the buffers are written one ``send`` each (OpenSSL cuts them into
records anyway, so there is no joining copy either).

**The native path.** Where pip built :mod:`._mover` (C; optional), plain
sockets' writes and reads run on a native thread with its own ``epoll``,
without the GIL. Each operation is first tried on the calling thread, so a
socket with room or data costs no hand-off; only what is left waits on the
thread. One ``Mover`` belongs to each trio run (a ``RunVar``), with a system
task that turns its completions into task wake-ups: a task that sends a 1 MiB
chunk wakes once, however often the kernel woke the thread for room meanwhile.
Measured against the pure-Python loop in docs/wan.md ("The native data
path"); :func:`native_path` says which is in use, and ``PDDNET_NATIVE=0`` in
the environment (read at import) turns it off. It keeps the pure-Python
loop's guarantees:

* a read into a permit's blocks stops, with not one byte more landing, the
  moment the permit is revoked (the revocation takes the operation back from
  the thread synchronously: ``Mover.cancel`` returns only once the thread is
  out of its system call);
* a cancelled wait takes its operation back the same way;
* :func:`close` takes back every operation on a socket before closing it, and
  their tasks get :class:`trio.ClosedResourceError`, as
  ``trio.lowlevel.notify_closing`` gives trio's own waits.
"""

from __future__ import annotations

import errno
import importlib
import itertools
import os
import socket
import ssl
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import outcome
import trio
import xxhash
from crc32c import crc32c

from ...wire import ChecksumAlgo

try:
    from . import _mover
except ImportError:  # not built here: the pure-Python loop runs
    _mover = None  # type: ignore[assignment]

__all__ = [
    "Digest",
    "EndOfStream",
    "FrameReader",
    "LowWater",
    "Revoked",
    "accept",
    "close",
    "connect",
    "digest_of",
    "native_path",
    "open_native",
    "recv_exact",
    "send_all",
]

_IOV_MAX = 512  # well under Linux's 1024
K_RCVLOWAT = 256 << 10  # most bytes to wait for before a readable wake-up
# OpenSSL may hold part of a record already (up to 16 KiB of plaintext plus its
# overhead), so on TLS fewer wire bytes than the plaintext still wanted may
# complete it: the low-water mark stays this far below what we want.
K_TLS_RECORD_MARGIN = 17 << 10
K_TLS_POLL_S = 0.001


class EndOfStream(Exception):
    """The peer closed the connection."""


class Revoked(Exception):
    """The destination's write permit was revoked; ``got`` bytes had landed."""

    def __init__(self, got: int) -> None:
        super().__init__(got)
        self.got = got


class Permit(Protocol):
    live: bool

    def watch(self, key: object, on_revoke: Callable[[], None]) -> None: ...

    def unwatch(self, key: object) -> None: ...


class LowWater:
    """A socket's ``SO_RCVLOWAT`` as last set, so that it is set only when it changes.

    One per socket, passed to every :func:`recv_exact` on it (the kernel's
    default, 1, to start).
    """

    __slots__ = ("sock", "value")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.value = 1

    def set(self, want: int) -> None:
        if want != self.value:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            self.value = want


async def recv_exact(
    sock: socket.socket,
    mv: memoryview,
    lowat: LowWater,
    permit: Permit | None = None,
    digest: Digest | None = None,
) -> None:
    """Fill ``mv`` from ``sock`` (``recv_into`` straight into it).

    Args:
        lowat: ``sock``'s low-water mark (see :class:`LowWater`).
        permit: checked right before every ``recv_into`` (no await between):
            once ``permit.live`` is false, nothing more is read into ``mv``.
        digest: updated with the bytes as they are read, while still in cache
            (on a revoke or an error it holds part of them).

    Raises:
        EndOfStream: if the peer closes first.
        Revoked: if the permit was revoked before ``mv`` was full.
        OSError: on a socket error (``ssl.SSLError`` on a TLS one).
    """
    await trio.lowlevel.checkpoint_if_cancelled()
    if isinstance(sock, ssl.SSLSocket):
        await _recv_exact_tls(sock, mv, lowat, permit)
        if digest is not None:
            digest.update(mv)
        return
    native = _native_io()
    if native is not None:
        await native.recv_exact(sock.fileno(), mv, lowat, permit, digest)
        return
    got, n = 0, len(mv)
    while got < n:
        if permit is not None and not permit.live:
            raise Revoked(got)
        try:
            k = sock.recv_into(mv[got:] if got else mv)
        except BlockingIOError:
            pass
        else:
            if not k:
                raise EndOfStream
            if digest is not None:
                digest.update(mv[got : got + k])
            got += k
            if got == n:
                break
        # The queue is empty now (a short read takes all there is, so no recv_into
        # into EAGAIN first). Wake only when a useful amount is queued (never more
        # than we need, so this cannot stall): on a WAN path data trickles in one
        # packet at a time, and one event-loop pass per 9 KB packet costs more CPU
        # than the copy itself.
        lowat.set(min(n - got, K_RCVLOWAT))
        await trio.lowlevel.wait_readable(sock)


class FrameReader:
    """Reads fixed-size frames (the receiver's acks), every queued one per ``recv_into``.

    One ``recv_into`` per frame, with a wake-up and an ``SO_RCVLOWAT`` change each,
    was a third of the sender's system calls on a fast path; acks come in bursts,
    so a buffered read serves several of them per call.
    """

    __slots__ = ("_buf", "_hi", "_lo", "_size", "_sock")

    def __init__(self, sock: socket.socket, size: int, frames: int = 128) -> None:
        self._sock = sock
        self._size = size
        self._buf = memoryview(bytearray(size * frames))
        self._lo = self._hi = 0

    async def read(self) -> memoryview:
        """The next frame; valid until the next call.

        Raises:
            EndOfStream: if the peer closes first (a partial frame is dropped).
            OSError: on a socket error (``ssl.SSLError`` on a TLS one).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        size, buf = self._size, self._buf
        while self._hi - self._lo < size:
            if len(buf) - self._lo < size:  # too little room behind: move the tail to the front
                tail = self._hi - self._lo
                buf[:tail] = buf[self._lo : self._hi]
                self._lo, self._hi = 0, tail
            try:
                k = self._sock.recv_into(buf[self._hi :])
            except (BlockingIOError, ssl.SSLWantReadError):
                await trio.lowlevel.wait_readable(self._sock)
                continue
            except ssl.SSLWantWriteError:
                await trio.sleep(K_TLS_POLL_S)  # a TLS key update; see _recv_exact_tls
                continue
            except ssl.SSLZeroReturnError:
                raise EndOfStream from None
            if not k:
                raise EndOfStream
            self._hi += k
        lo = self._lo
        self._lo += size
        if self._lo == self._hi:
            self._lo = self._hi = 0
        return buf[lo : lo + size]


async def _recv_exact_tls(
    sock: ssl.SSLSocket, mv: memoryview, lowat: LowWater, permit: Permit | None
) -> None:
    got, n = 0, len(mv)
    while got < n:
        if permit is not None and not permit.live:
            raise Revoked(got)
        try:
            k = sock.recv_into(mv[got:] if got else mv)
        except ssl.SSLWantReadError:
            lowat.set(max(1, min(n - got - K_TLS_RECORD_MARGIN, K_RCVLOWAT)))
            await trio.lowlevel.wait_readable(sock)
            continue
        except ssl.SSLWantWriteError:
            # A read that must write first (a TLS 1.3 key update). Another task may be
            # waiting for writability on this socket (trio allows one): poll instead.
            await trio.sleep(K_TLS_POLL_S)
            continue
        except ssl.SSLZeroReturnError:
            raise EndOfStream from None
        if not k:
            raise EndOfStream
        got += k


def can_trail(sock: socket.socket) -> bool:
    """Whether :func:`send_all` can hash as it writes and trail the digest on ``sock``
    (the native mover with its own XXH3, on a plain socket)."""
    return K_NATIVE_XXH3 and not isinstance(sock, ssl.SSLSocket)


async def send_all(
    sock: socket.socket,
    bufs: list[memoryview],
    trail: Digest | None = None,
    hash_from: int = 0,
    *,
    room: bool = False,
) -> None:
    """Send every buffer in order with ``sendmsg`` (gather write, no joining copy).

    Args:
        trail: a fresh XXH3 :class:`Digest`, only where :func:`can_trail`: the
            bytes from offset ``hash_from`` on are hashed right after they are
            written (still in cache), and the digest follows them as an 8-byte
            little-endian trailer (a chunk trailer, docs/wire.md); ``trail``
            then holds it.
        room: return only once the socket has room again too (writable: under
            its unsent low-water mark), the wait a writer makes before its next
            write; the native mover waits for it on its thread, so the caller
            wakes once for both.

    Raises:
        ValueError: ``trail`` where :func:`can_trail` is false.
    """
    await trio.lowlevel.checkpoint_if_cancelled()
    if trail is not None and (not can_trail(sock) or trail.native is None):
        raise ValueError("a trailed send needs the native mover's XXH3 and a plain socket")
    if isinstance(sock, ssl.SSLSocket):
        await _send_all_tls(sock, bufs)
    elif (native := _native_io()) is not None:
        await native.send_all(sock.fileno(), bufs, trail, hash_from, room)
        return
    else:
        await _send_all_plain(sock, bufs)
    if room:
        await trio.lowlevel.wait_writable(sock)


async def _send_all_plain(sock: socket.socket, bufs: list[memoryview]) -> None:
    i = 0
    while i < len(bufs):
        try:
            n = sock.sendmsg(bufs[i : i + _IOV_MAX])
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        while n:
            head = bufs[i]
            if n >= len(head):
                n -= len(head)
                i += 1
            else:
                bufs[i] = head[n:]
                n = 0


async def _send_all_tls(sock: ssl.SSLSocket, bufs: list[memoryview]) -> None:
    for buf in bufs:
        while buf:
            try:
                n = sock.send(buf)
            except ssl.SSLWantWriteError:
                # OpenSSL keeps what it encrypted; the retry passes the same bytes
                await trio.lowlevel.wait_writable(sock)
                continue
            except ssl.SSLWantReadError:
                # a write that must read first (renegotiation is off, so hardly
                # ever); the reading task owns wait_readable: poll instead
                await trio.sleep(K_TLS_POLL_S)
                continue
            buf = buf[n:]


async def connect(sock: socket.socket, addr: tuple[str, int]) -> None:
    """Non-blocking connect of ``sock`` (already non-blocking) to ``addr``.

    Raises:
        OSError: if the connection fails.
    """
    await trio.lowlevel.checkpoint_if_cancelled()
    err = sock.connect_ex(addr)
    if err in (errno.EINPROGRESS, errno.EAGAIN):
        await trio.lowlevel.wait_writable(sock)
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise OSError(err, f"connect to {addr[0]}:{addr[1]}: {errno.errorcode.get(err, err)}")


async def accept(lsock: socket.socket) -> socket.socket:
    """Accept one connection on a non-blocking listening socket."""
    await trio.lowlevel.checkpoint_if_cancelled()
    while True:
        try:
            sock, _ = lsock.accept()
        except BlockingIOError:
            await trio.lowlevel.wait_readable(lsock)
            continue
        sock.setblocking(False)
        return sock


def close(sock: socket.socket) -> None:
    """Close a socket other tasks may be waiting on (they get ClosedResourceError)."""
    if sock.fileno() != -1:
        _forget(sock.fileno())
        trio.lowlevel.notify_closing(sock)
        sock.close()


K_NATIVE = _mover is not None and os.environ.get("PDDNET_NATIVE", "1") != "0"


def native_path() -> str:
    """``"native"`` if this process's WAN sockets use the native mover, else ``"python"``."""
    return "native" if K_NATIVE else "python"


class _NativeIO:
    """One trio run's ``Mover`` and the task that delivers its completions."""

    def __init__(self) -> None:
        assert _mover is not None
        self._mover = _mover.Mover()
        self._waiting: dict[int, trio.lowlevel.Task] = {}
        self._tokens = itertools.count(1)

    async def _deliver(self) -> None:
        fd = self._mover.fileno()
        try:
            while True:
                await trio.lowlevel.wait_readable(fd)
                for token, status, done, lowat in self._mover.completions():
                    task = self._waiting.pop(token, None)
                    if task is not None:
                        trio.lowlevel.reschedule(task, outcome.Value((status, done, lowat)))
        finally:
            self._mover.close()

    async def _wait(self, token: int, lowat: LowWater | None = None) -> tuple[int, int, int]:
        self._waiting[token] = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            taken = self._mover.cancel(token)
            if taken is None:
                return trio.lowlevel.Abort.FAILED  # finished: its completion wakes us
            del self._waiting[token]
            if lowat is not None:
                lowat.value = taken[1]
            return trio.lowlevel.Abort.SUCCEEDED

        result: tuple[int, int, int] = await trio.lowlevel.wait_task_rescheduled(abort)
        return result

    async def send_all(
        self,
        fd: int,
        bufs: Sequence[memoryview],
        trail: Digest | None,
        hash_from: int,
        room: bool,
    ) -> None:
        """Write every buffer in order (the caller has checkpointed), then, with
        ``trail``, its digest of the bytes from ``hash_from`` on; with ``room``,
        end once the socket has room again (see :func:`send_all`).

        Cancellation stops the write part-way (the stream is then unusable).

        Raises:
            OSError: on a socket error.
        """
        token = next(self._tokens)
        native = None if trail is None else trail.native
        status, _, _ = self._mover.send(fd, bufs, token, native, hash_from, room)
        if status == _mover.PENDING:
            status, _, _ = await self._wait(token)
            if status:
                raise OSError(status, f"send: {os.strerror(status)}")
        elif room:
            # done here, with room left: still a schedule point, as the wait for
            # room is elsewhere, so one stream cannot take every chunk in a row
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def recv_exact(
        self,
        fd: int,
        mv: memoryview,
        lowat: LowWater,
        permit: Permit | None,
        digest: Digest | None,
    ) -> None:
        """Fill ``mv`` (the caller has checkpointed); ``lowat`` follows the socket,
        ``digest`` the bytes (on the thread if it is native, else after the read).

        Raises:
            EndOfStream: if the peer closes first.
            Revoked: if ``permit`` was revoked before ``mv`` was full.
            OSError: on a socket error.
        """
        if permit is not None and not permit.live:
            raise Revoked(0)
        token = next(self._tokens)
        native = None if digest is None else digest.native
        status, _, lowat.value = self._mover.recv(fd, mv, token, lowat.value, K_RCVLOWAT, native)
        if status == _mover.PENDING:
            if permit is not None:
                permit.watch(token, lambda: self._revoke(token, lowat))
            try:
                status, _, lowat.value = await self._wait(token, lowat)
            finally:
                if permit is not None:
                    permit.unwatch(token)
        if status == _mover.EOF:
            raise EndOfStream
        if status:
            raise OSError(status, f"recv: {os.strerror(status)}")
        if digest is not None and native is None:
            digest.update(mv)

    def _revoke(self, token: int, lowat: LowWater) -> None:
        taken = self._mover.cancel(token)
        if taken is None:
            return  # it had finished: its completion wakes the task
        lowat.value = taken[1]
        task = self._waiting.pop(token)
        trio.lowlevel.reschedule(task, outcome.Error(Revoked(taken[0])))

    def forget(self, fd: int) -> None:
        for token in self._mover.cancel_fd(fd):
            task = self._waiting.pop(token, None)
            if task is not None:
                err = trio.ClosedResourceError("the socket was closed")
                trio.lowlevel.reschedule(task, outcome.Error(err))


_RUN: trio.lowlevel.RunVar[_NativeIO | None] = trio.lowlevel.RunVar("pddnet_native_io")


def _native_io() -> _NativeIO | None:
    """This trio run's :class:`_NativeIO` (started on first use), or None without one."""
    if not K_NATIVE:
        return None
    io = _RUN.get(None)
    if io is None:
        io = _NativeIO()
        _RUN.set(io)
        trio.lowlevel.spawn_system_task(io._deliver, name="pddnet native mover")
    return io


def open_native() -> None:
    """Start this trio run's native mover now, if there is one (its thread and three
    descriptors then exist from a service's start, not from its first read)."""
    _native_io()


def _forget(fd: int) -> None:
    """Take back every native operation on ``fd`` before it is closed."""
    if not K_NATIVE:
        return
    try:
        io = _RUN.get(None)
    except RuntimeError:  # not in a trio run
        return
    if io is not None:
        io.forget(fd)


def _bind_xxh3() -> bool:
    """Whether the mover can hash XXH3 itself (python-xxhash's own functions)."""
    if not K_NATIVE:
        return False
    try:
        path = importlib.import_module("xxhash._xxhash").__file__
    except ImportError:
        return False
    return path is not None and bool(_mover.bind_xxh3(path))


K_NATIVE_XXH3 = _bind_xxh3()


class Digest:
    """Incremental payload checksum, equal to :func:`pddnet.wire.checksum` of the whole.

    With the native mover, an XXH3 digest is the mover's ``Xxh3`` (python-xxhash's
    code), which :func:`recv_exact` lets the mover's thread update as it reads.
    """

    __slots__ = ("_algo", "_crc", "_h")

    def __init__(self, algo: ChecksumAlgo) -> None:
        self._algo = algo
        self._crc = 0
        self._h: Any = None
        if algo == ChecksumAlgo.XXH3_64:
            self._h = _mover.Xxh3() if K_NATIVE_XXH3 else xxhash.xxh3_64()

    @property
    def native(self) -> Any:
        """The mover's ``Xxh3`` behind this digest, or None."""
        return self._h if K_NATIVE_XXH3 else None

    def update(self, data: memoryview) -> None:
        if self._h is not None:
            self._h.update(data)
        elif self._algo == ChecksumAlgo.CRC32C:
            self._crc = crc32c(data, self._crc)

    def value(self) -> int:
        if self._h is not None:
            return int(self._h.intdigest())
        return self._crc if self._algo == ChecksumAlgo.CRC32C else 0


def digest_of(pieces: list[memoryview], algo: ChecksumAlgo) -> int:
    """The checksum of the concatenation of ``pieces``."""
    d = Digest(algo)
    for p in pieces:
        d.update(p)
    return d.value()
