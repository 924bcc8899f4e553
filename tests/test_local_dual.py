"""Dual-path send: every block to RLD, the DRC delta to MD, layer by layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import trio

from pddnet import LocalProtocolError, TransferCancelled
from pddnet._optional import available
from pddnet.cache import CacheMirror, CacheServer, RadixCache
from pddnet.kv import KVLayout, KVPool
from pddnet.transport import TransferState
from pddnet.transport.dual import DualTransfer, PathPlan, layer_plans
from pddnet.transport.wan import WanReceiver, WanSender

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, block_size=4)


def filled(blocks: int, seed: int) -> KVPool:
    pool = KVPool.allocate(LAYOUT, blocks)
    rng = np.random.default_rng(seed)
    for b in pool.buffers:
        b.view(np.uint8)[...] = rng.integers(0, 256, b.view(np.uint8).shape, dtype=np.uint8)
    return pool


def blocks_equal(a: KVPool, a_ids: list[int], b: KVPool, b_ids: list[int]) -> bool:
    return a.read(a.ranges(a_ids)) == b.read(b.ranges(b_ids))


async def test_dual_send_rld_all_md_delta_layer_by_layer() -> None:
    tokens = list(range(1000, 1000 + 4 * 12 + 2))  # 12 full blocks + a partial one
    p_ids = [int(x) for x in np.random.default_rng(1).permutation(40)[:13]]
    p_pool = filled(40, 2)
    # MD already holds the first 7 blocks (an earlier turn) in its DRC.
    md_pool = KVPool.allocate(LAYOUT, 50, fill=0xEE)
    md_cache = RadixCache(LAYOUT.block_size)
    md_hit_ids = [3, 9, 4, 20, 21, 22, 30]
    for pid, mid in zip(p_ids[:7], md_hit_ids, strict=True):  # as if sent earlier
        md_pool.write(md_pool.ranges([mid]), p_pool.read(p_pool.ranges([pid])))
    md_cache.insert(tokens[:28], md_hit_ids)
    server = CacheServer(md_cache, epoch=5)
    mirror = CacheMirror(LAYOUT.block_size, bytes_per_token=LAYOUT.kv_bytes_per_token)
    for ev in server.events():
        mirror.apply(ev)
    md_cache.evict(2)  # a race: MD drops 2 blocks the mirror still counts on
    plan, req = mirror.plan("r1", tokens)
    plan = mirror.confirm(plan, server.handle_plan(req, now=0.0))
    assert plan.predicted_blocks == 7 and plan.hit_blocks == 5
    delta = plan.send_blocks().tolist()
    assert delta == list(range(5, 13))

    rld_pool = KVPool.allocate(LAYOUT, 30, fill=0x11)
    rld_ids = list(range(2, 15))
    md_new = [40 + i for i in range(len(delta))]
    to_rld = layer_plans(LAYOUT, 40, p_ids, 30, rld_ids)
    to_md = layer_plans(LAYOUT, 40, [p_ids[i] for i in delta], 50, md_new)
    rld, md = WanReceiver(), WanReceiver()
    async with rld, md, WanSender(rld.address) as tx_rld, WanSender(md.address) as tx_md:
        g_rld = [rld.grant(rld_pool.host_views(), r) for r in to_rld.dst]
        g_md = [md.grant(md_pool.host_views(), r) for r in to_md.dst]
        dual = DualTransfer(
            p_pool.host_views(),
            {
                "rld": PathPlan(tx_rld, g_rld, to_rld.src),
                "md": PathPlan(tx_md, g_md, to_md.src),
            },
            LAYOUT.num_layers,
        )
        with trio.fail_after(20):
            for layer in range(LAYOUT.num_layers):  # prefill produces layers in order
                assert dual.layer_states("rld")[layer] is None
                dual.layer_ready(layer)
                await dual.wait_layer("rld", layer)
                await md.wait_transfer(g_md[layer].transfer_id)
                await dual.wait_layer("md", layer)
            errors = await dual.run_to_end()
    assert errors == {"rld": None, "md": None}
    assert dual.state("rld") is TransferState.DONE and dual.state("md") is TransferState.DONE
    assert blocks_equal(rld_pool, rld_ids, p_pool, p_ids)
    md_view = [int(x) for x in server.plan(plan.plan_id or 0).hit_block_ids] + md_new
    assert blocks_equal(md_pool, md_view, p_pool, p_ids)  # MD's prompt KV equals P's
    server.complete(plan.plan_id or 0, md_new)


async def test_cancel_md_keeps_rld_running() -> None:
    src = filled(20, 3)
    rld_pool, md_pool = KVPool.allocate(LAYOUT, 20), KVPool.allocate(LAYOUT, 20, fill=0x77)
    plans = layer_plans(LAYOUT, 20, list(range(10)), 20, list(range(10)))
    rld, md = WanReceiver(), WanReceiver()
    async with rld, md, WanSender(rld.address) as tx_rld, WanSender(md.address) as tx_md:
        g_rld = [rld.grant(rld_pool.host_views(), r) for r in plans.dst]
        g_md = [md.grant(md_pool.host_views(), r) for r in plans.dst]
        dual = DualTransfer(
            src.host_views(),
            {
                "rld": PathPlan(tx_rld, g_rld, plans.src),
                "md": PathPlan(tx_md, g_md, plans.src),
            },
            LAYOUT.num_layers,
        )
        with pytest.raises(LocalProtocolError):
            dual.layer_ready(LAYOUT.num_layers)
        dual.layer_ready(0)
        dual.cancel("md")  # strange traffic: RLD already answered
        with trio.fail_after(20):
            dual.all_ready()
            errors = await dual.run_to_end()
            with pytest.raises(TransferCancelled):
                await dual.wait_layer("md", 2)
    assert errors["rld"] is None and isinstance(errors["md"], TransferCancelled)
    assert dual.state("md") is TransferState.CANCELLED
    assert dual.layer_states("md")[1:] == [None, None]  # later layers never started
    assert blocks_equal(rld_pool, list(range(10)), src, list(range(10)))
    untouched = KVPool.allocate(LAYOUT, 20, fill=0x77)
    keep = list(range(10, 20))
    assert md_pool.read(md_pool.ranges(keep)) == untouched.read(untouched.ranges(keep))


# ------------------------------------------------------------ three processes
UCX = available("ucxx._lib.libucxx")
ENV = {**os.environ, "UCX_TLS": "tcp,sm,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}

PEER = """
import json, os, sys, trio, numpy as np
from pddnet.kv import KVLayout, KVPool
from pddnet.transport import Grant
from pddnet.transport.dual import DualTransfer, PathPlan, layer_plans

role = sys.argv[1]
L = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16)
P_IDS = [int(x) for x in np.random.default_rng(5).permutation(64)[:24]]
RLD_IDS = list(range(3, 27))
HIT = 9                                # MD's DRC holds the first 9 blocks
MD_HIT_IDS = list(range(50, 59))
MD_NEW = list(range(10, 25))           # fresh MD blocks for the 15-block delta

def p_pool():
    pool = KVPool.allocate(L, 64)
    rng = np.random.default_rng(6)
    for b in pool.buffers:
        b.view(np.uint8)[...] = rng.integers(0, 256, b.view(np.uint8).shape, dtype=np.uint8)
    return pool

def say(obj):
    print(json.dumps(obj), flush=True)

async def receiver(kind):
    if kind == "rld":
        from pddnet.transport.local import UcxReceiver as Rx
        pool = KVPool.allocate(L, 32, fill=0x11)
        plans = layer_plans(L, 64, P_IDS, 32, RLD_IDS)
    else:
        from pddnet.transport.wan import WanReceiver as Rx
        pool = KVPool.allocate(L, 64, fill=0x22)
        src = p_pool()   # MD's cached prefix: written by an earlier transfer
        for pid, mid in zip(P_IDS[:HIT], MD_HIT_IDS):
            pool.write(pool.ranges([mid]), src.read(src.ranges([pid])))
        plans = layer_plans(L, 64, P_IDS[HIT:], 64, MD_NEW)
    async with Rx() as rx:
        gs = [rx.grant(pool.host_views(), r, timeout=60) for r in plans.dst]
        say([rx.address, [[g.transfer_id, g.total, list(g.layer_ends), g.address] for g in gs]])
        for g in gs:
            await rx.wait_transfer(g.transfer_id)
        ids = RLD_IDS if kind == "rld" else MD_HIT_IDS + MD_NEW
        got = pool.read(pool.ranges(ids))
        want = p_pool().read(p_pool().ranges(P_IDS))
        say({"kind": kind, "equal": got == want, "bytes": len(got)})
        # Stay up until P is done: its last acknowledgements may still be in flight.
        await trio.to_thread.run_sync(sys.stdin.readline)

async def prefill():
    from pddnet.transport.local import UcxSender
    from pddnet.transport.wan import WanSender
    (rld_addr, rld_g), (md_addr, md_g) = json.loads(sys.stdin.readline())
    pool = p_pool()
    to_rld = layer_plans(L, 64, P_IDS, 32, RLD_IDS)
    to_md = layer_plans(L, 64, P_IDS[HIT:], 64, MD_NEW)
    grants = lambda gs: [Grant(t, n, tuple(e), a) for t, n, e, a in gs]
    async with UcxSender(rld_addr) as tx_rld, WanSender(md_addr) as tx_md:
        dual = DualTransfer(pool.host_views(), {
            "rld": PathPlan(tx_rld, grants(rld_g), to_rld.src),
            "md": PathPlan(tx_md, grants(md_g), to_md.src)}, L.num_layers)
        for layer in range(L.num_layers):
            dual.layer_ready(layer)
            await trio.sleep(0.01)   # prefill computing the next layer
        errors = await dual.run_to_end()
        say({k: (None if v is None else repr(v)) for k, v in errors.items()})

try:
    trio.run(prefill if role == "p" else receiver, *([] if role == "p" else [role]))
except BaseException:
    import traceback; traceback.print_exc(); sys.stderr.flush(); os._exit(1)
os._exit(0)
"""


@pytest.mark.ucx
@pytest.mark.skipif(not UCX, reason="ucxx is not installed")
def test_three_processes_bit_for_bit() -> None:
    """P sends over UCX to RLD (all 24 blocks) and over TCP to MD (15-block delta)."""
    code = textwrap.dedent(PEER)
    procs = {}
    try:
        for role in ("rld", "md"):
            procs[role] = subprocess.Popen(
                [sys.executable, "-c", code, role],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=ENV,
            )
        hello = []
        for role in ("rld", "md"):
            out = procs[role].stdout
            assert out is not None
            line = out.readline()
            assert line.startswith("["), procs[role].stderr.read()  # type: ignore[union-attr]
            hello.append(json.loads(line))
        p = subprocess.run(
            [sys.executable, "-c", code, "p"],
            input=json.dumps(hello) + "\n",
            capture_output=True,
            text=True,
            timeout=90,
            env=ENV,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        assert json.loads(p.stdout.strip().splitlines()[-1]) == {"rld": None, "md": None}
        for role in ("rld", "md"):
            out_text, err = procs[role].communicate("bye\n", timeout=60)
            assert procs[role].returncode == 0, err[-3000:]
            result = json.loads(out_text.strip().splitlines()[-1])
            assert result == {"kind": role, "equal": True, "bytes": result["bytes"]}
            assert result["bytes"] == 24 * LAYOUT_3P_BLOCK_BYTES
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


LAYOUT_3P_BLOCK_BYTES = KVLayout(
    num_layers=4, num_kv_heads=2, head_dim=64, block_size=16
).block_bytes
