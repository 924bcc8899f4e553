"""``pddnet demo``: the most complete flow pddnet runs today.

Three OS processes play P, RLD and MD. They meet on the authenticated
control plane (each pair exchanges ``Hello`` with its KV layout), measure
their round trips, and P builds the transfer plans it would send: every
block to RLD, and only the blocks MD lacks to MD. The KV bytes themselves
move once the WAN and local transports land; this demo says so plainly
rather than pretending.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import secrets
import time
from typing import Any

import numpy as np
import trio

from .control import ControlNode
from .kv import KVLayout, TransferPlan
from .wire import Hello, Message

__all__ = ["add_arguments", "main"]

K_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--json", metavar="PATH", help="write the summary as JSON")


def _role(name: str, key: bytes, conn: Any) -> None:
    async def serve() -> None:
        async with ControlNode(name, secret=key) as node:

            def on_hello(peer: str, msg: Hello) -> Message:
                layout = KVLayout.from_dict(json.loads(msg.handshake))
                K_LAYOUT.check_compatible(layout)
                return Hello(name, 1, json.dumps(K_LAYOUT.to_dict()).encode())

            node.route(Hello, on_hello)
            conn.send(node.address)
            await trio.sleep_forever()

    trio.run(serve)


def main(args: argparse.Namespace) -> int:
    key = secrets.token_bytes(32)
    ctx = mp.get_context("spawn")
    procs, addrs = [], {}
    print("pddnet demo (foundation stage): P, RLD and MD as three processes on loopback")
    print("  note: KV transports, handoff and recompute are not wired in yet;")
    print("        this run shows the control plane and the transfer plans only.")
    for name in ("rld", "md"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_role, args=(name, key, child), daemon=True)
        proc.start()
        procs.append(proc)
        addrs[name] = parent.recv()
    rng = np.random.default_rng(0)
    n_requests = 20 if args.quick else 100
    summary: dict[str, Any] = {}

    async def prefill() -> None:
        async with ControlNode("p", secret=key) as node:
            blob = json.dumps(K_LAYOUT.to_dict()).encode()
            for name, addr in addrs.items():
                await node.connect(name, addr)
                reply = await node.request(name, Hello("p", 1, blob), timeout=10)
                assert isinstance(reply, Hello)
                rtts = sorted([await node.ping(name) for _ in range(200)])
                summary[f"{name}_rtt_p50_us"] = rtts[100] * 1e6
                print(f"  P <-> {name}: handshake ok, control RTT p50 {rtts[100] * 1e6:.0f} us")
            sent_rld = sent_md = 0
            t0 = time.perf_counter()
            for _ in range(n_requests):
                tokens = int(rng.integers(512, 8192))
                blocks = K_LAYOUT.blocks_for_tokens(tokens)
                hit = 0.97 if rng.random() < 0.75 else float(rng.uniform(0, 0.6))
                cached = int(blocks * hit)
                src = np.arange(blocks)
                to_rld = TransferPlan.build(K_LAYOUT, 1 << 16, src, 1 << 16, src)
                to_md = TransferPlan.build(K_LAYOUT, 1 << 16, src[cached:], 1 << 16, src[cached:])
                sent_rld += to_rld.total
                sent_md += to_md.total
            plan_ms = (time.perf_counter() - t0) * 1e3
            summary.update(
                requests=n_requests,
                bytes_planned_to_rld=sent_rld,
                bytes_planned_to_md=sent_md,
                wan_bytes_ratio=sent_md / sent_rld,
                plan_ms_total=plan_ms,
            )
            print(
                f"  {n_requests} requests planned in {plan_ms:.1f} ms: "
                f"{sent_rld / 1e6:.1f} MB to RLD (all blocks), {sent_md / 1e6:.1f} MB to MD "
                f"(prefix misses only, {sent_md / sent_rld:.0%} of it)"
            )

    try:
        trio.run(prefill)
    finally:
        for proc in procs:
            proc.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary}, f, indent=2)
    return 0
