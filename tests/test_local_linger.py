"""The local path's linger (issue 20 item 4): back-to-back small transfers find
both ends awake; an idle end goes back to sleep on epoll within the linger."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pddnet._optional import available

sys.path.insert(0, str(Path(__file__).parent))
from ucx_child import RUN_MAIN, run_child

UCX = available("ucxx._lib.libucxx")

BURST = (
    """
import os, sys, time, trio, numpy as np
from pddnet.kv import ByteRanges
from pddnet.transport.local import UcxReceiver, UcxSender
from pddnet.transport.local import _worker

N = 50

async def main():
    src = np.random.default_rng(5).integers(0, 256, 4096, dtype=np.uint8)
    one = ByteRanges.build([0], [0], [4096], [0])
    async with UcxReceiver() as rx, UcxSender(rx.address) as tx:
        async def one_transfer(dst):
            g = rx.grant([dst], one)
            async with trio.open_nursery() as n:
                n.start_soon(rx.wait_transfer, g.transfer_id)
                await tx.send(g, [src], one, timeout=10)
        with trio.fail_after(30):
            for _ in range(3):  # warm-up: the session is admitted
                await one_transfer(np.zeros(4096, np.uint8))
            # A transfer counts as back to back when it finished within
            # K_BURST_GAP_US of the previous one; on a slow shared machine one
            # in-process 4 KiB transfer alone can take longer (measured: median
            # 400 µs, tail 1.7 ms), which would make this a timing test. Widen
            # the gap for the burst: what is tested is that ends that know the
            # transfers come back to back stay awake between them.
            gap, _worker.K_BURST_GAP_US = _worker.K_BURST_GAP_US, 1e6
            r0, s0 = rx.statistics().epoll_waits, tx.statistics().epoll_waits
            dsts = [np.zeros(4096, np.uint8) for _ in range(N)]
            for dst in dsts:
                await one_transfer(dst)
            r1, s1 = rx.statistics().epoll_waits, tx.statistics().epoll_waits
            _worker.K_BURST_GAP_US = gap
            c0 = time.process_time()
            await trio.sleep(0.1)  # idle: both ends stop lingering and sleep
            idle_cpu = time.process_time() - c0
            r2, s2 = rx.statistics().epoll_waits, tx.statistics().epoll_waits
            st = tx.statistics()
            p0 = st.poll_rounds + st.linger_rounds
            spaced = [np.zeros(4096, np.uint8) for _ in range(20)]
            for dst in spaced:  # isolated transfers: nobody lingers after them
                await trio.sleep(0.003)
                await one_transfer(dst)
            st = tx.statistics()
            p1 = st.poll_rounds + st.linger_rounds
        assert all(np.array_equal(d, src) for d in dsts + spaced), "data differs"
        print("BURST", r1 - r0, s1 - s0, "IDLE", r2 - r1, s2 - s1, "CPU", idle_cpu,
              "SPACED", p1 - p0, flush=True)

"""
    + RUN_MAIN
)


@pytest.mark.ucx
@pytest.mark.skipif(not UCX, reason="ucxx is not installed")
def test_back_to_back_small_transfers_do_not_sleep() -> None:
    """50 transfers of 4 KiB one after another: neither end sleeps on epoll
    between them (before the linger: at least one sleep per transfer and end);
    once idle, both ends sleep again and burn little CPU; 20 transfers 3 ms
    apart do not linger (the sender polls a few rounds after the burst, not
    after each of them)."""
    out = run_child(BURST, timeout=60)
    w = out.split()
    at = w.index("BURST")
    rx_burst, tx_burst = int(w[at + 1]), int(w[at + 2])
    cpu = float(w[at + 7])
    # Of 50 transfers; without the linger each end sleeps at least once per
    # transfer (>= 50). On a slow or loaded machine the next transfer's event
    # can come later than the 200 µs linger now and then (seen here: 1-20
    # sleeps per end over 8 runs), so the bound is well above that.
    assert rx_burst <= 35 and tx_burst <= 35, out
    # Asleep again once idle: 100 ms of lingering or polling would burn about
    # 0.1 s; the linger (200 µs) and one nap cost well under 0.03. (The IDLE
    # counts are printed only: an end that fell asleep before the count was
    # read waits on in that same sleep and adds none.)
    assert cpu < 0.03, out
    assert int(w[at + 9]) <= 60, out  # spaced (lingering after each: ~280)
