"""The bulk chunk size: large while only bulk runs, the path's from an urgent transfer's start."""

from __future__ import annotations

import numpy as np
import trio

from pddnet.kv import ByteRanges
from pddnet.transport.wan import WanReceiver, WanSender, WanTransfer
from pddnet.transport.wan._sender import K_BULK_CHUNK

MIB = 1 << 20


def test_bulk_chunk_policy_with_explicit_times() -> None:
    from pddnet.transport.wan._pacer import UnsentMark
    from pddnet.transport.wan._sender import bulk_chunk_size

    m = UnsentMark(256 << 10, MIB, hold=0.2)

    big = K_BULK_CHUNK

    def size(now: float, urgent: bool, path: int = MIB, largest: int = 16 * MIB) -> int:
        m.update(now, urgent)
        return bulk_chunk_size(path, largest=largest, bulk_only=m.bulk_only(now))

    assert size(0.0, urgent=False) == big  # bulk alone: large
    assert size(1.0, urgent=True) == MIB  # an urgent transfer starts: the path's at once
    assert size(1.5, urgent=True) == MIB
    assert size(2.0, urgent=False) == MIB  # it ended at 2.0: held with the mark
    assert size(2.19, urgent=False) == MIB
    assert size(2.2, urgent=False) == big  # the hold is over
    assert size(2.3, urgent=True) == MIB
    assert size(2.35, urgent=False) == MIB
    assert size(2.45, urgent=True) == MIB  # a train keeps it small
    assert size(2.65, urgent=False) == MIB
    assert size(2.84, urgent=False) == MIB  # the hold counts from the last end
    assert size(2.85, urgent=False) == big
    # at most max_chunk_size: a fixed chunk_size (largest == path) never grows
    assert size(3.0, urgent=False, largest=MIB) == MIB
    assert size(3.0, urgent=False, largest=2 * MIB) == 2 * MIB
    # a fast path's own size is kept in either state (above K_BULK_CHUNK too)
    assert size(3.0, urgent=False, path=16 * MIB) == 16 * MIB
    assert size(3.1, urgent=True, path=4 * MIB) == 4 * MIB
    # no unsent mark at all (low 0): the chunk size still follows the urgent state
    n = UnsentMark(0, MIB, hold=0.2)
    assert n.update(0.0, urgent=False) == 0 and n.bulk_only(0.0)
    assert n.update(1.0, urgent=True) == 0 and not n.bulk_only(1.0)
    assert n.update(1.1, urgent=False) == 0 and not n.bulk_only(1.1)
    assert n.bulk_only(1.3)


def _chunks(acked: list[int]) -> list[int]:
    """Chunk lengths from a progress callback's cumulative verified bytes (one per ack)."""
    return [b - a for a, b in zip([0, *acked], acked, strict=False)]


async def _send(
    rx: WanReceiver, tx: WanSender, nbytes: int, *, priority: int = 0, ready: bool = True
) -> tuple[WanTransfer, list[int], np.ndarray, np.ndarray]:
    src = np.random.default_rng(nbytes + priority).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    ranges = ByteRanges.build([0], [0], [nbytes], [0])
    grant = rx.grant([dst], ranges)
    acked: list[int] = []
    t = tx.start(
        grant,
        [src],
        ranges,
        priority=priority,
        ready=ready,
        progress=lambda _tid, done, _total: acked.append(done),
    )
    return t, acked, src, dst


async def test_bulk_chunks_large_alone_and_the_path_size_while_urgent_runs() -> None:
    # A rate cap (100 MB/s a stream) makes loopback a path whose own size is 1 MiB:
    # path_chunk_size grows chunks only where a stream moves them in 2 ms.
    async with (
        WanReceiver() as rx,
        WanSender(rx.address, streams=2, pacer="fixed", rate_cap=200e6) as tx,
    ):
        await tx.wait_connected()
        with trio.fail_after(5):  # the cap applied and sampled
            while max(s.pacing_rate for s in tx.statistics().streams[:2]) > 100e6:
                await trio.sleep(0.02)

        # bulk alone: K_BULK_CHUNK (8 MiB) chunks, the tail striped smaller over
        # the two streams
        big = tx.statistics().chunk_size
        assert big == K_BULK_CHUNK == 8 * MIB
        t, acked, src, dst = await _send(rx, tx, 48 * MIB)
        with trio.fail_after(20):
            await t.wait()
        assert np.array_equal(src, dst)
        sizes = _chunks(acked)
        assert sum(sizes) == 48 * MIB
        assert max(sizes) == big and sizes.count(big) >= 4, sizes

        # an urgent transfer queued (not ready yet): bulk is cut at the path's size
        u, _, usrc, udst = await _send(rx, tx, 256 << 10, priority=1, ready=False)
        assert tx.statistics().chunk_size == MIB  # set in start(), before any pull
        t, acked, src, dst = await _send(rx, tx, 8 * MIB)
        with trio.fail_after(20):
            await t.wait()
        assert np.array_equal(src, dst)
        sizes = _chunks(acked)
        assert sum(sizes) == 8 * MIB and max(sizes) == MIB, sizes
        u.mark_ready(0, 256 << 10)
        with trio.fail_after(10):
            await u.wait()
        assert np.array_equal(usrc, udst)
        assert tx.statistics().chunk_size == MIB  # held with the mark after it ended
        with trio.fail_after(5):
            while tx.statistics().chunk_size == MIB:  # grows once the hold is over
                await trio.sleep(0.02)
        assert tx.statistics().chunk_size == big
