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
            r0, s0 = rx.statistics().epoll_waits, tx.statistics().epoll_waits
            dsts = [np.zeros(4096, np.uint8) for _ in range(N)]
            for dst in dsts:
                await one_transfer(dst)
            r1, s1 = rx.statistics().epoll_waits, tx.statistics().epoll_waits
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
    once idle, each end sleeps again and burns little CPU; 20 transfers 3 ms
    apart do not linger (the sender polls a few rounds after the burst, not
    after each of them)."""
    out = run_child(BURST, timeout=60)
    w = out.split()
    at = w.index("BURST")
    rx_burst, tx_burst, rx_idle, tx_idle = (
        int(w[at + 1]),
        int(w[at + 2]),
        int(w[at + 4]),
        int(w[at + 5]),
    )
    cpu = float(w[at + 7])
    # Of 50 transfers; without the linger each end sleeps at least once per
    # transfer (>= 50). A loaded 2-core CI machine can deschedule one end past
    # the 200 µs linger now and then (seen: 12 sleeps), so the bound is half.
    assert rx_burst <= 25 and tx_burst <= 25, out
    assert rx_idle >= 1 and tx_idle >= 1, out  # asleep again once idle
    assert cpu < 0.03, out  # 100 ms idle: the linger (200 µs) and one nap
    assert int(w[at + 9]) <= 60, out  # spaced (lingering after each: ~280)
