"""Chunk checksum trailers (docs/wire.md): the header's flag, the mover's hashed
send, the receiver's check, and a sender that uses them for bulk chunks only.

Real sockets; the mover's tests skip without it, and the end-to-end test runs on
the pure-Python loop too (test_wan_native runs this file with PDDNET_NATIVE=0),
where every chunk keeps its checksum in the header.
"""

from __future__ import annotations

import os
import socket
import struct

import pytest
import trio
import xxhash

from pddnet._errors import RemoteProtocolError
from pddnet.bench._hostile_wan import SECRET, authenticated
from pddnet.kv import ByteRanges
from pddnet.transport.wan import WanReceiver, WanSender, _io
from pddnet.wire import (
    K_CHUNK_FLAG_TRAILER,
    K_CHUNK_TRAILER_SIZE,
    ChecksumAlgo,
    ChunkHeader,
)

NATIVE = _io.K_NATIVE_XXH3
native_only = pytest.mark.skipif(not NATIVE, reason="no native mover with XXH3")


def test_the_trailer_flag_round_trips_and_is_checked() -> None:
    h = ChunkHeader(3, 4096, 1 << 20, 0, ChecksumAlgo.XXH3_64, flags=K_CHUNK_FLAG_TRAILER)
    back = ChunkHeader.decode(h.encode())
    assert back == h and back.trailer == K_CHUNK_TRAILER_SIZE == 8
    assert ChunkHeader(3, 0, 1, 5).trailer == 0
    both = ChunkHeader(3, 0, 1, 5, ChecksumAlgo.XXH3_64, flags=K_CHUNK_FLAG_TRAILER)
    with pytest.raises(RemoteProtocolError, match="both in the header and in a trailer"):
        ChunkHeader.decode(both.encode())
    with pytest.raises(RemoteProtocolError, match="unknown chunk flags 0x2"):
        ChunkHeader.decode(ChunkHeader(3, 0, 1, 0, flags=0x2).encode())


def _pair(rcvbuf: int) -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, rcvbuf)
    for s in (a, b):
        s.setblocking(False)
    return a, b


@native_only
async def test_a_trailed_send_hashes_what_it_wrote_and_appends_the_digest() -> None:
    """Through the thread (small socket buffers: many partial writes), the bytes
    from hash_from on are hashed, and their digest follows them."""
    a, b = _pair(64 << 10)
    head, body = os.urandom(40), [os.urandom(3 << 20), b"", os.urandom((2 << 20) + 7)]
    payload = b"".join(body)
    want = len(head) + len(payload) + 8
    got = bytearray()
    digest = _io.Digest(ChecksumAlgo.XXH3_64)

    async def read() -> None:
        buf = bytearray(1 << 20)
        while len(got) < want:
            await trio.lowlevel.wait_readable(b)
            try:
                n = b.recv_into(buf)
            except BlockingIOError:
                continue
            got.extend(buf[:n])

    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            n.start_soon(read)
            bufs = [memoryview(head), *map(memoryview, body)]
            await _io.send_all(a, bufs, digest, len(head))
    h = xxhash.xxh3_64_intdigest(payload)
    assert bytes(got[:40]) == head and bytes(got[40:-8]) == payload
    assert struct.unpack("<Q", got[-8:])[0] == h == digest.value()
    with pytest.raises(ValueError, match="native"):
        await _io.send_all(a, [memoryview(b"x")], _io.Digest(ChecksumAlgo.CRC32C))
    a.close()
    b.close()


async def _send_raw(address: str, frame: bytes) -> None:
    sock = await authenticated(address)
    try:
        await trio.to_thread.run_sync(sock.sendall, frame)
        await trio.sleep(0.3)  # the receiver reads it before the connection closes
    finally:
        sock.close()


async def test_the_receiver_checks_a_trailer() -> None:
    """A trailer that does not match the payload fails the connection and
    verifies nothing; the chunk re-sent with the right one completes the grant."""
    size = 1 << 20
    src = os.urandom(size)
    dst = bytearray(size)
    ranges = ByteRanges.build([0], [0], [size], [0])
    h = xxhash.xxh3_64_intdigest(src)
    async with WanReceiver(secret=SECRET) as rx:
        g = rx.grant([dst], ranges, timeout=20)
        head = ChunkHeader(
            g.transfer_id, 0, size, 0, ChecksumAlgo.XXH3_64, flags=K_CHUNK_FLAG_TRAILER
        ).encode()
        with trio.fail_after(20):
            await _send_raw(rx.address, head + src + struct.pack("<Q", h ^ 1))
            st = rx.statistics()
            assert st.bytes_verified == 0 and st.protocol_errors == 1, st
            await _send_raw(rx.address, head + src + struct.pack("<Q", h))
            await rx.wait_transfer(g.transfer_id)
        assert dst == src
        assert rx.statistics().bytes_verified == size


async def test_bulk_chunks_carry_trailers_on_the_native_path() -> None:
    """12 MiB in 4 MiB chunks arrive whole; on the native path each chunk's first
    send carries a trailer, on the Python path none does; 256 KiB (urgent-size)
    chunks never do."""
    for chunk, n in ((4 << 20, 12 << 20), (256 << 10, 1 << 20)):
        src = os.urandom(n)
        dst = bytearray(n)
        ranges = ByteRanges.build([0], [0], [n], [0])
        async with WanReceiver() as rx, WanSender(rx.address, streams=2, chunk_size=chunk) as tx:
            g = rx.grant([dst], ranges, timeout=20)
            with trio.fail_after(20):
                await tx.send(g, [src], ranges)
                await rx.wait_transfer(g.transfer_id)
            st = tx.statistics()
        assert dst == src
        trailed = sum(s.chunks_trailed for s in st.streams)
        sent = sum(s.chunks_sent for s in st.streams)
        if NATIVE and chunk >= (1 << 20):
            assert trailed >= n // chunk and trailed <= sent, st
        else:
            assert trailed == 0, st
