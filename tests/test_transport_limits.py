"""Resource bounds of the WAN receiver (``WanLimits``): pure accounting, then real sockets."""

from __future__ import annotations

import os
import random
import socket

import pytest
import trio
import trio.socket as tsocket

from pddnet import LocalProtocolError, ResourceLimitError, TransferCancelled
from pddnet.kv import ByteRanges
from pddnet.transport.testing import make_case
from pddnet.transport.wan import GrantTable, WanLimitExceeded, WanLimits, WanReceiver, WanSender
from pddnet.wire import ChecksumAlgo, ChunkHeader, checksum

K_BOUND_S = 10.0
SECRET = b"limits-test-secret-0123456789abc"


def _ranges(n: int) -> ByteRanges:
    return ByteRanges.build([0], [0], [n], [0])


# -- pure: GrantTable accounting -------------------------------------------------


@pytest.mark.parametrize(
    ("limits", "name", "peer", "n"),
    [
        (WanLimits(max_transfers=2), "max_transfers", None, 10),
        (WanLimits(max_transfers_per_peer=2), "max_transfers_per_peer", "p0", 10),
        (WanLimits(max_bytes=25), "max_bytes", None, 10),
        (WanLimits(max_bytes_per_peer=25), "max_bytes_per_peer", "p0", 10),
    ],
)
def test_grant_over_a_bound_is_refused_before_registering(
    limits: WanLimits, name: str, peer: str | None, n: int
) -> None:
    t = GrantTable(1 << 20, limits)
    t.add(1, _ranges(n), peer=peer)
    t.add(2, _ranges(n), peer=peer)
    before = (len(t), t.bytes_granted, t.peer_usage("p0"))
    with pytest.raises(WanLimitExceeded) as info:
        t.add(3, _ranges(n), peer=peer)
    err = info.value
    assert isinstance(err, ResourceLimitError)
    assert (err.limit, err.transfer_id, err.peer) == (name, 3, peer)
    assert err.maximum == getattr(limits, name) and err.requested > err.maximum
    ctx = err.context()
    assert ctx["limit"] == name and ctx["requested"] == err.requested and ctx["transfer_id"] == 3
    assert (len(t), t.bytes_granted, t.peer_usage("p0")) == before
    assert 3 not in t
    # another peer is not held back by p0's per-peer bound
    if name.endswith("_per_peer"):
        t.add(4, _ranges(n), peer="p1")
        assert t.peer_usage("p1") == (1, n)


def test_peer_usage_returns_to_baseline_however_grants_end() -> None:
    t = GrantTable(1 << 20, WanLimits(max_transfers_per_peer=3, max_bytes_per_peer=300))
    hdr = ChunkHeader(1, 0, 100, 0)
    t.add(1, _ranges(100), peer="p")  # completes
    t.add(2, _ranges(100), peer="p", deadline=5.0)  # times out
    t.add(3, _ranges(100), peer="p")  # cancelled
    assert t.peer_usage("p") == (3, 300) and t.bytes_granted == 300
    with pytest.raises(WanLimitExceeded):
        t.add(4, _ranges(1), peer="p")
    t.begin(hdr, "c")
    t.finish(hdr, "c", ok=True)
    t.handle_timer(10.0)
    t.cancel(3)
    assert t.peer_usage("p") == (0, 0) and t.bytes_granted == 0 and len(t) == 0
    t.add(5, _ranges(50), peer="p")
    # a protocol violation ends the grant too
    with pytest.raises(Exception, match="outside grant"):
        t.begin(ChunkHeader(5, 40, 20, 0), "c")
    assert t.peer_usage("p") == (0, 0) and t.bytes_granted == 0


def test_random_grant_lifecycles_match_a_model() -> None:
    rng = random.Random(5)
    lim = WanLimits(
        max_transfers=6, max_transfers_per_peer=3, max_bytes=600, max_bytes_per_peer=250
    )
    t = GrantTable(1 << 20, lim)
    live: dict[int, tuple[str | None, int]] = {}
    for tid in range(1, 2000):
        if live and rng.random() < 0.45:
            victim = rng.choice(list(live))
            t.cancel(victim)
            del live[victim]
            continue
        peer = rng.choice(["a", "b", None])
        n = rng.randrange(1, 120)
        peer_live = [v for v in live.values() if v[0] == peer and peer is not None]
        fits = (
            len(live) < 6
            and sum(v[1] for v in live.values()) + n <= 600
            and (peer is None or (len(peer_live) < 3 and sum(v[1] for v in peer_live) + n <= 250))
        )
        try:
            t.add(tid, _ranges(n), peer=peer)
        except WanLimitExceeded:
            assert not fits
        else:
            assert fits
            live[tid] = (peer, n)
        assert t.bytes_granted == sum(v[1] for v in live.values())
        for p in ("a", "b"):
            mine = [v[1] for v in live.values() if v[0] == p]
            assert t.peer_usage(p) == (len(mine), sum(mine))


def test_limits_validate() -> None:
    with pytest.raises(LocalProtocolError, match="max_connections"):
        WanLimits(max_connections=0)
    with pytest.raises(LocalProtocolError, match="body_timeout"):
        WanLimits(body_timeout=-1.0)
    assert WanLimits(max_bytes=None, body_timeout=None).max_bytes is None


# -- real sockets ------------------------------------------------------------------


async def test_receiver_refuses_grant_over_per_peer_memory_then_accepts_after() -> None:
    n = 1 << 20
    src = bytearray(os.urandom(n))
    lim = WanLimits(max_bytes_per_peer=n + n // 2)
    async with WanReceiver(limits=lim) as rx, WanSender(rx.address, streams=2) as tx:
        dst, dst2 = bytearray(n), bytearray(n)
        g = rx.grant([dst], _ranges(n), peer="p0", timeout=K_BOUND_S)
        with pytest.raises(WanLimitExceeded) as info:
            rx.grant([dst2], _ranges(n), peer="p0", timeout=K_BOUND_S)
        assert info.value.peer == "p0" and info.value.requested == 2 * n
        assert rx.statistics().grants == 1 and rx.peer_usage("p0") == (1, n)
        rx.grant([bytearray(n)], _ranges(n), peer="p1")  # another peer is fine
        with trio.fail_after(K_BOUND_S):
            await tx.send(g, [src], _ranges(n), timeout=K_BOUND_S)
            await rx.wait_transfer(g.transfer_id)
        assert dst == src and rx.peer_usage("p0") == (0, 0)
        g2 = rx.grant([dst2], _ranges(n), peer="p0", timeout=K_BOUND_S)  # room again
        with trio.fail_after(K_BOUND_S):
            await tx.send(g2, [src], _ranges(n), timeout=K_BOUND_S)
        assert dst2 == src


async def test_connection_bound_per_peer_keeps_extra_streams_out() -> None:
    case = make_case(3, 3 << 20, pieces=5)
    async with WanReceiver(limits=WanLimits(max_connections_per_peer=2)) as rx:
        async with WanSender(rx.address, streams=4, chunk_size=256 << 10) as tx:
            grant = rx.grant(case.dst, case.dst_ranges, timeout=K_BOUND_S)
            with trio.fail_after(K_BOUND_S):
                await tx.send(grant, case.src, case.src_ranges, timeout=K_BOUND_S)
                await rx.wait_transfer(grant.transfer_id)
                while rx.statistics().limit_rejections == 0:
                    await trio.sleep(0.01)
            assert rx.statistics().connections <= 2
            assert sum(s.up for s in tx.statistics().streams) <= 2
            err = rx.last_limit_error
            assert err is not None and err.limit == "max_connections_per_peer"
            assert err.peer == "127.0.0.1" and err.maximum == 2
        case.check_complete()


async def _connect(address: str) -> tsocket.SocketType:
    host, port = address.rsplit(":", 1)
    sock = tsocket.socket()
    await sock.connect((host, int(port)))
    return sock


async def _closed_by_peer(sock: tsocket.SocketType) -> bool:
    with trio.move_on_after(K_BOUND_S):
        while True:
            try:
                if not await sock.recv(4096):
                    return True
            except OSError:
                return True
    return False


async def test_handshake_slots_bound_strangers_and_free_up() -> None:
    lim = WanLimits(max_handshakes=1)
    async with WanReceiver(secret=SECRET, limits=lim) as rx:
        silent = await _connect(rx.address)  # takes the only handshake slot
        with trio.fail_after(K_BOUND_S):
            while rx._handshakes == 0:
                await trio.sleep(0.01)
        second = await _connect(rx.address)
        # full: the oldest handshake is shed and the newcomer kept (issue 19, attack 2)
        assert await _closed_by_peer(silent), "the oldest handshake over max_handshakes was kept"
        silent.close()
        assert rx.statistics().handshakes_shed == 1 and rx._handshakes == 1
        second.close()
        # the slot is back: an honest sender authenticates and transfers
        n = 1 << 16
        src, dst = bytearray(os.urandom(n)), bytearray(n)
        async with WanSender(rx.address, secret=SECRET, streams=1) as tx:
            g = rx.grant([dst], _ranges(n), timeout=K_BOUND_S)
            with trio.fail_after(K_BOUND_S):
                await tx.send(g, [src], _ranges(n), timeout=K_BOUND_S)
        assert dst == src
    assert rx._handshakes == 0 and rx._conn_count == 0 and not rx._conns_per_ip


async def test_header_without_body_is_dropped_and_its_range_freed() -> None:
    case = make_case(4, 64 << 10, pieces=1)
    async with WanReceiver(limits=WanLimits(body_timeout=0.3)) as rx:
        grant = rx.grant(case.dst, case.dst_ranges, timeout=K_BOUND_S)
        payload = bytes(case.src[0][: 1 << 14])  # any bytes: never checked, never sent
        hdr = ChunkHeader(
            grant.transfer_id, 0, len(payload), checksum(ChecksumAlgo.CRC32C, payload)
        ).encode()
        sock = await _connect(rx.address)
        await sock.send(hdr + payload[:100])  # slowloris: header, a few bytes, then nothing
        assert await _closed_by_peer(sock)
        sock.close()
        assert rx.statistics().limit_rejections == 1
        err = rx.last_limit_error
        assert err is not None and err.limit == "body_timeout"
        assert err.transfer_id == grant.transfer_id and err.requested >= err.maximum == 0.3
        assert rx.statistics().grants == 1  # the transfer lives on; its range is free again
        async with WanSender(rx.address, streams=2, chunk_size=16 << 10, hedge=False) as tx:
            with trio.fail_after(K_BOUND_S):
                await tx.send(grant, case.src, case.src_ranges, timeout=K_BOUND_S)
                await rx.wait_transfer(grant.transfer_id)
        case.check_complete()
        assert rx.statistics().bytes_granted == 0


async def test_connection_accounting_returns_to_baseline() -> None:
    lim = WanLimits(max_connections=3)
    async with WanReceiver(limits=lim) as rx:
        socks = [await _connect(rx.address) for _ in range(3)]
        with trio.fail_after(K_BOUND_S):
            while rx._conn_count < 3:
                await trio.sleep(0.01)
        extra = await _connect(rx.address)
        assert await _closed_by_peer(extra)
        extra.close()
        assert rx.last_limit_error is not None and rx.last_limit_error.limit == "max_connections"
        for s in socks:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # RST
            s.close()
        with trio.fail_after(K_BOUND_S):
            while rx._conn_count or rx._conns_per_ip:
                await trio.sleep(0.01)
        g = rx.grant([bytearray(10)], _ranges(10))
        rx.cancel(g.transfer_id)
        with pytest.raises(TransferCancelled):
            await rx.wait_transfer(g.transfer_id)
