"""UCX's unexpected queue is swept: junk on tags nobody posted does not pile up.

A message whose tag no posted receive matches waits in UCX's unexpected queue,
payload and all, with no bound (measured: 100,000 4 KiB messages from a
stranger grew a receiver by 458 MB). The receiver drops such messages unless
something live awaits them. One child process (UCX ends with ``os._exit``)
holds a receiver with a live grant, an honest authenticated sender and a raw
ucxx stranger on three workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pddnet._optional import available

sys.path.insert(0, str(Path(__file__).parent))
from ucx_child import RUN_MAIN

UCX = available("ucxx._lib.libucxx")
ENV = {
    **os.environ,
    "UCX_TLS": os.environ.get("UCX_TLS", "tcp,sm,self"),
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}

CHILD = (
    """
import os, random, sys, trio, numpy as np
import ucxx._lib.libucxx as ucx
from ucxx._lib.arr import Array
from pddnet.kv import ByteRanges
from pddnet.transport.local import UcxReceiver, UcxSender
from pddnet.transport.local._addressing import parse_address

SECRET = b"pddnet-unexpected-test-0123456"
JUNK, SIZE = 3000, 4096

async def main():
    pool = np.full(3 * 65536, 0x11, np.uint8)
    ranges = ByteRanges.build([0], [65536], [65536], [0])
    async with UcxReceiver(secret=SECRET) as rx:
        g = rx.grant([pool], ranges, timeout=30)
        ctx = ucx.UCXContext({}, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        w = ucx.UCXWorker(ctx)
        ep = w.create_endpoint_from_worker_address(
            ucx.UCXAddress.create_from_buffer(parse_address(rx.address)[1]), False
        )
        junk = Array(bytearray(os.urandom(SIZE)))
        reqs = []
        rnd = random.Random(5)
        for i in range(JUNK):  # data-looking tags, sender inboxes, anything
            top = (0x8, 0xD, 0xF, 0x1)[i % 4]
            reqs.append(ep.tag_send(junk, ucx.UCXXTag(top << 60 | rnd.getrandbits(60))))
            if i % 64 == 0:
                w.progress()
                await trio.sleep(0)
        with trio.fail_after(20):
            while rx.statistics().unexpected_dropped < JUNK:
                w.progress()
                await trio.sleep(0.01)
        st = rx.statistics()
        assert st.unexpected_dropped == JUNK, st
        assert st.unexpected_dropped_bytes == JUNK * SIZE, st
        assert (pool == 0x11).all(), "junk touched the pool"
        # the honest sender's transfer still lands exactly
        src = np.arange(65536, dtype=np.uint8)
        async with UcxSender(rx.address.split("#")[0], secret=SECRET) as tx:
            with trio.fail_after(20):
                await tx.send(g, [src], ByteRanges.build([0], [0], [65536], [0]))
                await rx.wait_transfer(g.transfer_id)
        assert (pool[65536:131072] == src).all()
        assert (pool[:65536] == 0x11).all() and (pool[131072:] == 0x11).all()
        assert rx.statistics().unexpected_dropped == JUNK
        print("SWEPT", st.unexpected_dropped, st.unexpected_dropped_bytes, flush=True)

"""
    + RUN_MAIN
)


@pytest.mark.ucx
@pytest.mark.skipif(not UCX, reason="ucxx is not installed")
def test_junk_on_unposted_tags_is_swept() -> None:
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD)],
        capture_output=True,
        text=True,
        timeout=90,
        env=ENV,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SWEPT 3000 12288000" in r.stdout, r.stdout
