"""Control-plane round trip on loopback: pddnet vs a plain pyzmq REQ/REP pair.

Both servers run in their own OS process; both clients run in this process,
one after the other, interleaved in rounds so that machine noise hits both.
``rtt_ratio_vs_raw_zmq`` is pddnet's p50 round trip over raw pyzmq's p50, for
a Ping answered by a plain (synchronous) handler, the like of a REP echo.
``async_handler_rtt_ratio_vs_raw_zmq`` is the same for a request answered by an
async handler, which costs one more task switch on the server.
The pddnet round trip includes everything a real call pays: msgpack encoding,
schema checks, HMAC-SHA256 on both sides, replay checks and trio scheduling.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import time
from typing import Any

import trio
import zmq

from ..control import ControlNode
from ..wire import Message, Ping, Pong, message
from ._common import Progress, add_common_arguments, percentiles, print_table, write_report


@message(15)
class BenchEcho(Message):
    """Benchmark-only request, answered by an *async* handler (the general path)."""

    payload: bytes


async def _echo(peer: str, msg: BenchEcho) -> Message:
    await trio.lowlevel.checkpoint()
    return Pong(msg.payload)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, png=False)
    parser.add_argument("--iterations", type=int, default=None, help="round trips per method")
    parser.add_argument("--payload", type=int, default=64, help="payload bytes per request")


def _raw_server(ready: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    ready.send(port)
    while True:
        msg = sock.recv()
        if msg == b"stop":
            sock.send(b"")
            break
        sock.send(msg)
    sock.close(0)
    ctx.term()


def _pddnet_server(ready: Any, key: bytes) -> None:
    async def serve() -> None:
        async with ControlNode("bench-server", secret=key) as node:
            node.route(BenchEcho, _echo)
            ready.send(node.address)
            await trio.sleep_forever()

    trio.run(serve)


def _raw_client(port: int, n: int, payload: bytes) -> list[float]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.connect(f"tcp://127.0.0.1:{port}")
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.send(payload)
        sock.recv()
        out.append(time.perf_counter() - t0)
    sock.close(0)
    ctx.term()
    return out


async def _pddnet_client(
    node: ControlNode, n: int, payload: bytes, msg_cls: type[Message] = Ping
) -> list[float]:
    out = []
    msg = msg_cls(payload)  # type: ignore[call-arg]
    for _ in range(n):
        t0 = time.perf_counter()
        await node.request("bench-server", msg, timeout=5.0)
        out.append(time.perf_counter() - t0)
    return out


def run(iterations: int, payload_size: int, rounds: int = 10) -> dict[str, Any]:
    key = secrets.token_bytes(32)
    payload = os.urandom(payload_size)
    mpctx = mp.get_context("spawn")
    raw_parent, raw_child = mpctx.Pipe()
    pdd_parent, pdd_child = mpctx.Pipe()
    raw_proc = mpctx.Process(target=_raw_server, args=(raw_child,), daemon=True)
    pdd_proc = mpctx.Process(target=_pddnet_server, args=(pdd_child, key), daemon=True)
    raw_proc.start()
    pdd_proc.start()
    port = raw_parent.recv()
    address = pdd_parent.recv()
    raw: list[float] = []
    pdd: list[float] = []
    pdd_async: list[float] = []
    per_round = max(iterations // rounds, 1)

    async def client() -> None:
        async with ControlNode("bench-client", secret=key) as node:
            await node.connect("bench-server", address)
            await _pddnet_client(node, 50, payload)  # warm up the connection
            _raw_client(port, 50, payload)
            with Progress(rounds, "control rtt") as bar:
                for _ in range(rounds):
                    raw.extend(_raw_client(port, per_round, payload))
                    pdd.extend(await _pddnet_client(node, per_round, payload))
                    pdd_async.extend(await _pddnet_client(node, per_round, payload, BenchEcho))
                    bar.advance()

    try:
        trio.run(client)
        _raw_client_stop(port)
    finally:
        pdd_proc.kill()
        raw_proc.join(timeout=5)
        raw_proc.kill()
    return {"raw_zmq": raw, "pddnet": pdd, "pddnet_async_handler": pdd_async}


def _raw_client_stop(port: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(b"stop")
    if sock.poll(2000):
        sock.recv()
    sock.close(0)
    ctx.term()


def main(args: argparse.Namespace) -> int:
    iterations = args.iterations or (3000 if args.quick else 20000)
    samples = run(iterations, args.payload)
    stats = {name: percentiles([s * 1e6 for s in v]) for name, v in samples.items()}
    rows = [
        {
            "method": name,
            "n": len(samples[name]),
            **{k: st[k] for k in ("p50", "p99", "mean", "max")},
        }
        for name, st in stats.items()
    ]
    print_table(rows, title=f"control-plane round trip, {args.payload} B payload (us)")
    summary = {
        "p50_rtt_us": stats["pddnet"]["p50"],
        "p99_rtt_us": stats["pddnet"]["p99"],
        "raw_zmq_p50_rtt_us": stats["raw_zmq"]["p50"],
        "rtt_ratio_vs_raw_zmq": stats["pddnet"]["p50"] / stats["raw_zmq"]["p50"],
        "async_handler_p50_rtt_us": stats["pddnet_async_handler"]["p50"],
        "async_handler_rtt_ratio_vs_raw_zmq": stats["pddnet_async_handler"]["p50"]
        / stats["raw_zmq"]["p50"],
        "target_rtt_ratio_vs_raw_zmq": 1.5,
    }
    print(f"rtt_ratio_vs_raw_zmq = {summary['rtt_ratio_vs_raw_zmq']:.2f} (target <= 1.5)")
    write_report(args.json, summary, stats_us=stats, payload_bytes=args.payload)
    return 0
