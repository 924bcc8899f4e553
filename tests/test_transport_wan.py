"""The WAN transport on loopback: conformance, hostile senders, faults, recovery."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import pytest
import trio

from pddnet.transport import Receiver, Sender
from pddnet.transport.testing import CHECKS, check_transport
from pddnet.transport.wan import WanReceiver, WanSender, _io
from pddnet.transport.wan._io import EndOfStream, FrameReader, LowWater, recv_exact
from pddnet.transport.wan._sender import (
    K_DEFAULT_NOTSENT_LOWAT,
    K_FAST_NOTSENT_LOWAT,
    K_IDLE_NOTSENT_LOWAT,
)
from pddnet.transport.wan._sockopts import K_TCP_NOTSENT_LOWAT


def wan_maker(**kw: object):  # type: ignore[no-untyped-def]
    @asynccontextmanager
    async def maker() -> AsyncIterator[tuple[Sender, Receiver]]:
        async with WanReceiver() as rx:
            opts = {"streams": 3, "chunk_size": 256 << 10, **kw}
            async with WanSender(rx.address, **opts) as tx:  # type: ignore[arg-type]
                yield tx, rx

    return maker


async def test_conformance() -> None:
    ran = await check_transport(wan_maker())
    assert ran == list(CHECKS)


@pytest.mark.parametrize(
    "kw",
    [
        {"streams": 1, "hedge": False},
        {"algo": 1, "policy": "fifo"},
        {"streams": 2, "express_streams": 1, "pacer": "fixed", "rate_cap": 1e9},
    ],
)
async def test_conformance_variants(kw: dict[str, object]) -> None:
    ran = await check_transport(wan_maker(**kw), only=["roundtrip", "concurrent", "layers"])
    assert len(ran) == 3


# -- hostile senders (a raw socket speaking the chunk format) ------------------

import trio.socket as tsocket  # noqa: E402

from pddnet import RemoteProtocolError, TransferCancelled  # noqa: E402
from pddnet.transport.testing import make_case  # noqa: E402
from pddnet.transport.wan import LinkFrame, LinkKind  # noqa: E402
from pddnet.wire import ChecksumAlgo, ChunkHeader, checksum  # noqa: E402


async def _raw(address: str) -> tsocket.SocketType:
    host, port = address.rsplit(":", 1)
    sock = tsocket.socket()
    await sock.connect((host, int(port)))
    return sock


async def _replies(sock: tsocket.SocketType) -> tuple[list[LinkFrame], bool]:
    """Link frames the receiver sent back, and whether it then closed the connection."""
    data = b""
    with trio.move_on_after(5):
        while True:
            try:
                got = await sock.recv(65536)
            except OSError:
                got = b""
            if not got:
                frames = [
                    LinkFrame.decode(data[i : i + 40]) for i in range(0, len(data) // 40 * 40, 40)
                ]
                return frames, True
            data += got
    return [LinkFrame.decode(data[i : i + 40]) for i in range(0, len(data), 40)], False


def _chunk(
    tid: int, offset: int, payload: bytes, algo: ChecksumAlgo = ChecksumAlgo.CRC32C
) -> bytes:
    return ChunkHeader(tid, offset, len(payload), checksum(algo, payload), algo).encode() + payload


@pytest.mark.parametrize(
    "what",
    ["unknown_id", "out_of_grant", "straddles_end", "oversized", "partial_overlap", "wrong_id"],
)
async def test_hostile_chunks_rejected(what: str) -> None:
    case = make_case(7, 100_000, pieces=5)
    other = make_case(8, 50_000, pieces=2)
    async with WanReceiver(max_chunk=1 << 16) as rx:
        grant = rx.grant(case.dst, case.dst_ranges)
        sock = await _raw(rx.address)
        good = bytes(4096)
        if what == "unknown_id":
            msg = _chunk(grant.transfer_id ^ 1, 0, good)
        elif what == "wrong_id":  # a live grant of someone else, at an offset past its end
            g2 = rx.grant(other.dst, other.dst_ranges)
            msg = _chunk(g2.transfer_id, 60_000, good)
        elif what == "out_of_grant":
            msg = _chunk(grant.transfer_id, 200_000, good)
        elif what == "straddles_end":
            msg = _chunk(grant.transfer_id, 100_000 - 100, good)
        elif what == "oversized":
            big = bytes(1 << 17)
            msg = ChunkHeader(
                grant.transfer_id, 0, len(big), checksum(ChecksumAlgo.CRC32C, big)
            ).encode()
        else:
            msg = _chunk(grant.transfer_id, 0, good) + _chunk(grant.transfer_id, 2048, good)
        await sock.send(msg)
        frames, closed = await _replies(sock)
        sock.close()
        assert closed, "the receiver kept a misbehaving connection open"
        assert rx.statistics().protocol_errors == 1
        if what not in ("unknown_id",):
            tid = grant.transfer_id if what != "wrong_id" else g2.transfer_id
            assert any(f.kind is LinkKind.FAIL and f.transfer_id == tid for f in frames)
            with trio.fail_after(5):
                with pytest.raises(RemoteProtocolError):
                    await rx.wait_transfer(tid)
        if what == "partial_overlap":
            assert frames[0].kind is LinkKind.ACK  # the first, valid chunk counted
        case.check_outside_untouched()
        other.check_outside_untouched()


async def test_checksum_mismatch_drops_connection_not_transfer() -> None:
    case = make_case(9, 20_000, pieces=1)
    async with WanReceiver() as rx:
        grant = rx.grant(case.dst, case.dst_ranges)
        sock = await _raw(rx.address)
        payload = bytes(range(256)) * 16
        hdr = ChunkHeader(
            grant.transfer_id, 0, len(payload), checksum(ChecksumAlgo.CRC32C, payload) ^ 1
        )
        await sock.send(hdr.encode() + payload)
        frames, closed = await _replies(sock)
        assert closed and not frames
        assert rx.statistics().checksum_failures == 1
        assert rx.statistics().grants == 1  # still live: an honest sender re-sends
        # the bytes are unverified: a correct chunk for the same range is accepted
        sock2 = await _raw(rx.address)
        await sock2.send(_chunk(grant.transfer_id, 0, payload))
        with trio.fail_after(5):
            buf = await sock2.recv(40)
        assert LinkFrame.decode(buf).kind is LinkKind.ACK
        sock2.close()
        rx.cancel(grant.transfer_id)
        with pytest.raises(TransferCancelled):
            await rx.wait_transfer(grant.transfer_id)
        case.check_outside_untouched()


async def test_duplicate_of_verified_chunk_is_acked_and_dropped() -> None:
    case = make_case(11, 8192, pieces=1)
    async with WanReceiver() as rx:
        grant = rx.grant(case.dst, case.dst_ranges)
        sock = await _raw(rx.address)
        a = bytes([1]) * 4096
        await sock.send(
            _chunk(grant.transfer_id, 0, a) + _chunk(grant.transfer_id, 0, bytes([2]) * 4096)
        )
        with trio.fail_after(5):
            got = b""
            while len(got) < 80:
                got += await sock.recv(80 - len(got))
        kinds = [LinkFrame.decode(got[i : i + 40]).kind for i in (0, 40)]
        assert kinds == [LinkKind.ACK, LinkKind.ACK]
        d = case.dst_ranges
        b, o = int(d.buffer[0]), int(d.offset[0])
        assert (case.dst[b][o : o + 4096] == 1).all()  # the duplicate did not overwrite
        assert rx.statistics().bytes_dropped == 4096
        sock.close()
        rx.cancel(grant.transfer_id)


# -- faults: a proxy that refuses, kills mid-chunk, or slows connections --------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pddnet import PeerUnavailable  # noqa: E402

Fault = tuple[str, int]


async def _pump(src: tsocket.SocketType, dst: tsocket.SocketType, fault: Fault) -> None:
    kind, arg = fault
    moved = 0
    while True:
        want = 65536 if kind != "kill" else max(1, min(65536, arg - moved))
        data = await src.recv(want)
        if not data:
            return
        if kind == "slow":
            await trio.sleep(arg / 1000)
        await dst.send(data)
        moved += len(data)
        if kind == "kill" and moved >= arg:
            raise ConnectionResetError("killed by the fault schedule")


async def _proxy(target: str, faults: list[Fault], task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
    host, port = target.rsplit(":", 1)
    lsock = tsocket.socket()
    await lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)
    task_status.started(f"127.0.0.1:{lsock.getsockname()[1]}")
    k = 0
    async with trio.open_nursery() as n:
        while True:
            client, _ = await lsock.accept()
            fault = faults[k] if k < len(faults) else ("ok", 0)
            k += 1
            if fault[0] == "refuse":
                client.close()
                continue

            async def relay(client: tsocket.SocketType = client, fault: Fault = fault) -> None:
                up = tsocket.socket()
                try:
                    await up.connect((host, int(port)))
                    async with trio.open_nursery() as m:

                        async def one(
                            a: tsocket.SocketType, b: tsocket.SocketType, f: Fault
                        ) -> None:
                            with suppress(OSError):
                                await _pump(a, b, f)
                            m.cancel_scope.cancel()

                        m.start_soon(one, client, up, fault)
                        m.start_soon(one, up, client, ("ok", 0))
                finally:
                    client.close()
                    up.close()

            n.start_soon(relay)


async def _faulty_transfer(faults: list[Fault], seed: int, **kw: object) -> None:
    case = make_case(seed, 1_500_000, pieces=6)
    async with WanReceiver() as rx, trio.open_nursery() as n:
        addr = await n.start(_proxy, rx.address, faults)
        opts = {"streams": 3, "chunk_size": 64 << 10, "max_backoff": 0.05, **kw}
        async with WanSender(addr, **opts) as tx:  # type: ignore[arg-type]
            grant = rx.grant(case.dst, case.dst_ranges)
            with trio.fail_after(20):
                t = tx.start(grant, case.src, case.src_ranges)
                await t.wait()
                await rx.wait_transfer(grant.transfer_id)
            stats = tx.statistics()
        n.cancel_scope.cancel()
    case.check_complete()  # bit for bit, and nothing outside the grant touched
    assert stats.bytes_verified == case.total


fault_st = st.one_of(
    st.just(("ok", 0)),
    st.just(("refuse", 0)),
    st.tuples(st.just("kill"), st.integers(1, 400_000)),
    st.tuples(st.just("slow"), st.integers(1, 20)),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(fault_st, max_size=8), st.integers(0, 1000))
def test_integrity_under_random_faults(faults: list[Fault], seed: int) -> None:
    trio.run(_faulty_transfer, faults, seed)


async def test_stream_kill_resends_on_other_streams() -> None:
    # every first connection dies mid-chunk; the transfer still completes
    await _faulty_transfer([("kill", 100_000), ("kill", 70_001), ("kill", 1)], 3)


async def test_slow_stream_is_hedged() -> None:
    case = make_case(4, 600_000, pieces=2)
    async with WanReceiver() as rx, trio.open_nursery() as n:
        addr = await n.start(_proxy, rx.address, [("slow", 300)])
        # no express stream: the proxy must slow one of the two streams that carry bulk
        async with WanSender(addr, streams=2, chunk_size=64 << 10, express_streams=0) as tx:
            await tx.wait_connected()
            grant = rx.grant(case.dst, case.dst_ranges)
            with trio.fail_after(20):
                await tx.send(grant, case.src, case.src_ranges)
                await rx.wait_transfer(grant.transfer_id)
            assert tx.statistics().chunks_hedged >= 1
        n.cancel_scope.cancel()
    case.check_complete()


async def test_peer_death_is_a_typed_error_within_bound() -> None:
    case = make_case(5, 4 << 20, pieces=2)
    rx = WanReceiver()
    async with rx, WanSender(rx.address, streams=2, peer_timeout=0.5, max_backoff=0.05) as tx:
        await tx.wait_connected()
        grant = rx.grant(case.dst, case.dst_ranges)
        t = tx.start(grant, case.src, case.src_ranges, ready=False)
        await rx.aclose()  # the peer dies with the transfer pending
        with trio.fail_after(5), pytest.raises(PeerUnavailable):
            await t.wait()


async def test_urgent_pacing_caps_bulk_only_while_urgent_transfers_run() -> None:
    tx = WanSender("127.0.0.1:9", streams=4, congestion=None)
    tx._delivered.extend([(0.0, 100e6), (0.1, 80e6)])  # aggregate delivery samples
    assert tx._bulk_rate() is None  # bulk alone: the pacer's decision (unpaced)
    tx._sched.add_transfer(1, 100, priority=1)
    assert tx._bulk_rate() == pytest.approx(0.9 * 100e6 / 4)  # 0.9 x the peak, per stream
    tx._sched.cancel(1)
    tx._sched.events()
    assert tx._bulk_rate() is None
    off = WanSender("127.0.0.1:9", streams=4, congestion=None, urgent_pacing=None)
    off._delivered.append((0.0, 100e6))
    off._sched.add_transfer(1, 100, priority=1)
    assert off._bulk_rate() is None


async def test_chunk_size_follows_the_path_on_loopback() -> None:
    # loopback: microsecond RTT, no loss, GB/s per stream -> chunks above 1 MiB
    case = make_case(6, 24 << 20, pieces=3)
    async with WanReceiver() as rx, WanSender(rx.address, streams=2) as tx:
        await tx.wait_connected()
        assert tx.statistics().chunk_size > 1 << 20
        # the bulk streams' unsent low-water mark rises with the chunk; the express one's stays
        lowat = [_notsent_lowat(s.sock) for s in tx._streams]
        assert lowat == [K_FAST_NOTSENT_LOWAT] * 2 + [K_DEFAULT_NOTSENT_LOWAT]
        grant = rx.grant(case.dst, case.dst_ranges)
        with trio.fail_after(20):
            await tx.send(grant, case.src, case.src_ranges)
            await rx.wait_transfer(grant.transfer_id)
        assert sum(s.chunks_sent for s in tx.statistics().streams) < 24  # not 1 MiB chunks
    case.check_complete()
    async with WanReceiver() as rx, WanSender(rx.address, streams=2, chunk_size=256 << 10) as tx:
        await tx.wait_connected()
        await trio.sleep(0.15)  # a sampling period: a fixed size stays fixed
        assert tx.statistics().chunk_size == 256 << 10
        # not the fast path's mark: the bulk streams' is the idle one (tests/test_wan_mark.py)
        lowat = [_notsent_lowat(s.sock) for s in tx._streams]
        assert lowat == [K_IDLE_NOTSENT_LOWAT] * 2 + [K_DEFAULT_NOTSENT_LOWAT]


def _notsent_lowat(sock: socket.socket) -> int:
    return int(sock.getsockopt(socket.IPPROTO_TCP, K_TCP_NOTSENT_LOWAT))


async def test_frame_reader_serves_split_and_batched_frames() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    frames = [bytes([i % 251]) * 40 for i in range(300)]  # more than the reader's buffer holds
    wire = b"".join(frames)
    reader = FrameReader(a, 40, frames=4)
    got: list[bytes] = []

    async def write() -> None:
        for lo, hi in [(0, 7), (7, 40), (40, 200), (200, 2000), (2000, len(wire) - 13)]:
            b.sendall(wire[lo:hi])
            await trio.sleep(0.001)
        b.sendall(wire[len(wire) - 13 : -3])  # the last frame stops 3 bytes short
        b.close()

    async with trio.open_nursery() as n:
        n.start_soon(write)
        with pytest.raises(EndOfStream), trio.fail_after(5):
            while True:
                got.append(bytes(await reader.read()))
    assert got == frames[:-1]
    a.close()


class _CountingSocket(socket.socket):
    """A real TCP socket that records its ``SO_RCVLOWAT`` settings and its ``EAGAIN`` reads."""

    def __init__(self, fd: int) -> None:
        super().__init__(socket.AF_INET, socket.SOCK_STREAM, 0, fileno=fd)
        self.lowats: list[int] = []
        self.eagains = 0

    def setsockopt(self, level: int, opt: int, value: int) -> None:  # type: ignore[override]
        if (level, opt) == (socket.SOL_SOCKET, socket.SO_RCVLOWAT):
            self.lowats.append(value)
        super().setsockopt(level, opt, value)

    def recv_into(self, buf: memoryview, nbytes: int = 0, flags: int = 0) -> int:  # type: ignore[override]
        try:
            return super().recv_into(buf, nbytes, flags)
        except BlockingIOError:
            self.eagains += 1
            raise


async def test_recv_exact_sets_low_water_on_change_and_waits_after_short_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A payload trickling in: ``SO_RCVLOWAT`` is set only when the wanted size
    changes, and a short read waits at once (no ``recv_into`` into ``EAGAIN``),
    across calls on the same socket (issue 23). The pure-Python loop's calls
    (tests/test_wan_native.py checks the native mover's)."""
    monkeypatch.setattr(_io, "K_NATIVE", False)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        b = socket.create_connection(srv.getsockname())
        fd, _ = srv._accept()  # type: ignore[attr-defined]
    a = _CountingSocket(fd)
    a.setblocking(False)
    payload = bytes(range(256)) * (6 << 12)  # 6 MiB
    lowat = LowWater(a)

    async def write() -> None:
        for lo in range(0, len(payload), 64 << 10):
            b.sendall(payload[lo : lo + (64 << 10)])
            await trio.sleep(0.002)

    got = bytearray(len(payload))
    async with trio.open_nursery() as n:
        n.start_soon(write)
        with trio.fail_after(10):
            for lo in range(0, len(payload), 1 << 20):  # six reads, like six chunks
                await recv_exact(a, memoryview(got)[lo : lo + (1 << 20)], lowat)
    assert got == payload
    assert a.eagains <= 6  # only a call's first read may find nothing yet
    assert a.lowats, "a trickled payload must wait on the low-water mark"
    assert all(x != y for x, y in zip([1, *a.lowats], a.lowats, strict=False)), a.lowats
    assert lowat.value == a.lowats[-1]
    a.close()
    b.close()


async def test_padding_is_dropped_and_bounded() -> None:
    case = make_case(12, 8192, pieces=1)
    async with WanReceiver() as rx:
        grant = rx.grant(case.dst, case.dst_ranges)
        sock = await _raw(rx.address)
        pad = LinkFrame(LinkKind.PAD, 1, 0, 100_000).encode() + b"\xff" * 100_000
        payload = bytes(range(256)) * 32
        await sock.send(pad + _chunk(grant.transfer_id, 0, payload))  # padding, then a chunk
        with trio.fail_after(5):
            buf = await sock.recv(40)
            await rx.wait_transfer(grant.transfer_id)
        assert LinkFrame.decode(buf).kind is LinkKind.ACK  # nothing for the padding itself
        assert rx.statistics().bytes_verified == len(payload)
        sock.close()
        sock = await _raw(rx.address)
        await sock.send(LinkFrame(LinkKind.PAD, 1, 0, (4 << 20) + 1).encode())  # too much
        frames, closed = await _replies(sock)
        sock.close()
        assert closed and not frames
        assert rx.statistics().protocol_errors == 1
    case.check_outside_untouched()


async def test_express_stream_is_warmed_up_and_carries_no_bulk() -> None:
    from pddnet.transport.wan._sockopts import read_tcp_info

    case = make_case(13, 256 << 10, pieces=2)
    async with WanReceiver() as rx, WanSender(rx.address, streams=2) as tx:
        await tx.wait_connected()  # 2 bulk streams + the default express stream
        assert tx.statistics().streams[2].up
        sock = tx._streams[2].sock
        with trio.fail_after(5):  # its 1 MiB warm-up padding went out (TCP_INFO)
            while (info := read_tcp_info(sock, 2)) is None or info.bytes_sent < 1 << 20:
                await trio.sleep(0.02)
        grant = rx.grant(case.dst, case.dst_ranges)
        with trio.fail_after(10):
            await tx.send(grant, case.src, case.src_ranges)  # bulk: never on the express lane
        assert tx.statistics().streams[2].chunks_sent == 0
        urgent = make_case(14, 256 << 10, pieces=2)
        grant = rx.grant(urgent.dst, urgent.dst_ranges)
        with trio.fail_after(10):
            await tx.send(grant, urgent.src, urgent.src_ranges, priority=1)
    case.check_complete()
    urgent.check_complete()


def test_express_window_check() -> None:
    from pddnet.transport.wan._pacer import TcpSample
    from pddnet.transport.wan._sender import K_EXPRESS_MIN_WINDOW, express_window_ok

    def sample(wnd: int) -> TcpSample:
        return TcpSample(8, 0.03, 0.03, 1e6, 1 << 20, 0, snd_wnd=wnd)

    assert not express_window_ok(sample(94208))  # stuck at its initial ~10 segments
    assert express_window_ok(sample(K_EXPRESS_MIN_WINDOW))
    assert express_window_ok(sample(0)) and express_window_ok(None)  # not reported


async def test_narrow_express_window_reopens_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pddnet.transport.wan._sender as sender_mod

    case = make_case(15, 256 << 10, pieces=2)
    async with WanReceiver() as rx, WanSender(rx.address, streams=2) as tx:
        await tx.wait_connected()
        await trio.sleep(0.1)  # loopback's window is wide: connected once, kept
        assert tx.statistics().streams[2].connects == 1 and tx._streams[2].reopens == 0
    # every window "too narrow": re-opened K_EXPRESS_REOPENS times, then kept as it is
    monkeypatch.setattr(sender_mod, "K_EXPRESS_MIN_WINDOW", 1 << 40)
    async with WanReceiver() as rx, WanSender(rx.address, streams=2) as tx:
        with trio.fail_after(10):
            while tx.statistics().streams[2].connects <= sender_mod.K_EXPRESS_REOPENS:
                await trio.sleep(0.01)
        grant = rx.grant(case.dst, case.dst_ranges)
        with trio.fail_after(10):  # urgent transfers still complete
            await tx.send(grant, case.src, case.src_ranges, priority=1)
        await trio.sleep(0.1)
        assert tx.statistics().streams[2].connects == sender_mod.K_EXPRESS_REOPENS + 1
    case.check_complete()
