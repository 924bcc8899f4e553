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
"""

from __future__ import annotations

import errno
import socket
import ssl
from typing import Protocol

import trio
import xxhash
from crc32c import crc32c

from ...wire import ChecksumAlgo

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
    sock: socket.socket, mv: memoryview, lowat: LowWater, permit: Permit | None = None
) -> None:
    """Fill ``mv`` from ``sock`` (``recv_into`` straight into it).

    Args:
        lowat: ``sock``'s low-water mark (see :class:`LowWater`).
        permit: checked right before every ``recv_into`` (no await between):
            once ``permit.live`` is false, nothing more is read into ``mv``.

    Raises:
        EndOfStream: if the peer closes first.
        Revoked: if the permit was revoked before ``mv`` was full.
        OSError: on a socket error (``ssl.SSLError`` on a TLS one).
    """
    await trio.lowlevel.checkpoint_if_cancelled()
    if isinstance(sock, ssl.SSLSocket):
        await _recv_exact_tls(sock, mv, lowat, permit)
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


async def send_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    """Send every buffer in order with ``sendmsg`` (gather write, no joining copy)."""
    await trio.lowlevel.checkpoint_if_cancelled()
    if isinstance(sock, ssl.SSLSocket):
        await _send_all_tls(sock, bufs)
        return
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
        trio.lowlevel.notify_closing(sock)
        sock.close()


class Digest:
    """Incremental payload checksum, equal to :func:`pddnet.wire.checksum` of the whole."""

    __slots__ = ("_algo", "_crc", "_h")

    def __init__(self, algo: ChecksumAlgo) -> None:
        self._algo = algo
        self._crc = 0
        self._h = xxhash.xxh3_64() if algo == ChecksumAlgo.XXH3_64 else None

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
