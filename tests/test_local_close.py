"""Closing the local path never blocks on a peer that is not progressed.

ucxx's endpoint destructor closes an endpoint in UCX's flush mode and
progresses its worker until the flush completes, with no bound. Over ``tcp``
(with ``posix``/``sysv`` but without ``cma``, the rendezvous goes over tcp
PUT) the receiver's endpoint back to a sender then waits for that sender's
PUT ACK, so a sender never progressed again (one in this process whose task
ended, a stopped one) made a garbage collection spin forever at 100 % CPU
(docs/local.md, *Closing endpoints*). Receiver and sender now start closing
their endpoints themselves, without blocking, while their workers still run.

Each case runs in a child process (a hang must not hang pytest): a receiver
and a sender in one trio run, each in its own task, move 1 MiB; then one end
closes before the other (the sender possibly halted first: never progressed
again); then ``gc.collect()`` must return and the child exit 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pddnet._optional import available

UCX = available("ucxx._lib.libucxx")
ucx = pytest.mark.skipif(not UCX, reason="ucxx is not installed")

CHILD = """
import gc, os, sys, time, trio, numpy as np
from pddnet.kv import ByteRanges
from pddnet.transport.local import UcxReceiver, UcxSender

CMA, ORDER, SIZE = sys.argv[1] == "1", sys.argv[2], 1 << 20
SECRET = b"local-close-secret-0123456789"
HOLD = []  # the ends stay referenced until the collection, as in a test run

async def main():
    src = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    dst = np.zeros(SIZE, np.uint8)
    r = ByteRanges.build([0], [0], [SIZE], [0])
    ready, moved, rx_go, tx_go = trio.Event(), trio.Event(), trio.Event(), trio.Event()

    async def receiver():
        async with UcxReceiver(secret=SECRET, cma=CMA) as rx:
            HOLD.append(rx)
            ready.set()
            await rx_go.wait()
        tx_go.set()

    async def sender():
        await ready.wait()
        rx = HOLD[0]
        async with UcxSender(rx.address, secret=SECRET) as tx:
            HOLD.append(tx)
            g = rx.grant([dst], r)
            await tx.start(g, [src], r).wait()
            await rx.wait_transfer(g.transfer_id)
            assert (dst == src).all()
            if ORDER == "rx_first_halted":
                tx._service.worker.halt()  # never progressed again
            moved.set()
            await tx_go.wait()
        rx_go.set()

    async with trio.open_nursery() as n:
        n.start_soon(receiver)
        n.start_soon(sender)
        await moved.wait()
        (tx_go if ORDER == "tx_first" else rx_go).set()

trio.run(main)
HOLD.clear()
t0 = time.perf_counter()
gc.collect()
print(f"collected in {time.perf_counter() - t0:.3f} s", flush=True)
os._exit(0)  # ucxx's interpreter-exit teardown is not what this tests
"""


@pytest.mark.ucx
@ucx
@pytest.mark.parametrize("order", ["rx_first", "rx_first_halted", "tx_first"])
@pytest.mark.parametrize("cma", ["0", "1"])
def test_close_and_collect_never_hang(cma: str, order: str) -> None:
    """Over ``tcp,sm,self`` (cma=0: ``tcp,posix,sysv,self``) both ends close and
    the collection returns; before, cma=0 with the receiver closing first hung."""
    env = {**os.environ, "UCX_TLS": "tcp,sm,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    try:
        p = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(CHILD), cma, order],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"cma={cma} {order}: closing or collecting did not return in 60 s")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "collected in" in p.stdout, p.stdout
