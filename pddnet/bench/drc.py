"""DRC: WAN bytes with and without the decode-side radix cache on a skewed multi-turn trace.

Replays a synthetic multi-turn / agent trace through the real DRC code:
P's own prefix cache (a :class:`~pddnet.cache.RadixCache`), P's
:class:`~pddnet.cache.CacheMirror` fed by MD's events with a lag of a few
requests (so some predictions are stale and the handshake corrects them),
and MD's :class:`~pddnet.cache.CacheServer` with a bounded cache (LRU
eviction). Each request goes through the plan handshake (messages encoded
and decoded with the real control-frame codec); MD caches the prompt when
the delta lands and prompt + output when decoding ends, as an engine's radix
cache does.

The trace: sessions share a few system prompts; a session opens with a
document (log-normal, median 3K tokens: the low-hit tail), then each turn
appends the model's output and a short user or tool message; 8% of turns
paste a large tool output (median 6K tokens). About 75% of requests then hit
more than 95% and the mean hit is about 90%, the skew the PDD source reports.

WAN bytes "without DRC" send every prompt's whole KV; "with DRC" send only
the confirmed delta. ``delta_ms_128k`` is the time P takes to compute the
delta of a 128K-token prompt (hash chain + mirror lookup, 16-token blocks,
median of repeated runs).
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from ..cache import CacheMirror, CacheServer, DrcEvicted, DrcInserted, RadixCache, block_hashes
from ..kv import KVLayout
from ..wire import Message, decode_frame, encode_frame
from ._common import add_common_arguments, percentiles, print_table, pyplot, write_report

K_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)  # Llama-3-8B
K_VOCAB = 32000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--requests", type=int, default=None, help="requests in the trace")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--md-capacity", type=int, default=48_000, help="MD cache capacity in blocks"
    )
    parser.add_argument("--p-capacity", type=int, default=48_000, help="P cache capacity (blocks)")
    parser.add_argument("--sessions", type=int, default=24, help="concurrently active sessions")
    parser.add_argument("--event-lag", type=int, default=3, help="requests before P sees events")
    parser.add_argument("--seed", type=int, default=0)


MsgT = TypeVar("MsgT", bound=Message)
Trace = list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]


def make_trace(n_requests: int, *, sessions: int = 24, seed: int = 0) -> Trace:
    """A skewed multi-turn trace: ``[(prompt, output), ...]`` in arrival order."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, K_VOCAB, int(rng.integers(1000, 4000))) for _ in range(6)]
    active: list[dict[str, Any]] = []
    out: Trace = []

    def new_session() -> dict[str, Any]:
        sys_prompt = systems[int(rng.integers(len(systems)))]
        doc_len = int(np.clip(rng.lognormal(np.log(3000), 1.0), 100, 60_000))
        ctx = np.concatenate([sys_prompt, rng.integers(0, K_VOCAB, doc_len)])
        return {"ctx": ctx, "turns": int(rng.geometric(1 / 16))}

    while len(out) < n_requests:
        while len(active) < sessions:
            active.append(new_session())
        i = int(rng.integers(len(active)))
        s = active[i]
        prompt = s["ctx"]
        output = rng.integers(0, K_VOCAB, int(np.clip(rng.lognormal(np.log(200), 0.7), 10, 2000)))
        out.append((prompt, output))
        s["turns"] -= 1
        if s["turns"] <= 0:
            active.pop(i)
            continue
        if rng.random() < 0.08:  # a large tool output or pasted file
            msg = int(np.clip(rng.lognormal(np.log(6000), 0.8), 500, 40_000))
        else:
            msg = int(np.clip(rng.lognormal(np.log(150), 0.8), 5, 2000))
        s["ctx"] = np.concatenate([prompt, output, rng.integers(0, K_VOCAB, msg)])
    return out


def _wire(msg: MsgT, src: str, dst: str) -> MsgT:
    """Through the real control codec, as the control plane carries it."""
    frame = encode_frame(msg, key=b"bench", src=src, dst=dst, seq=1)
    out = decode_frame(frame, key=b"bench", src=src, dst=dst).message
    assert type(out) is type(msg)
    return out


class _Ids:
    """Fake pool block ids (the bench tracks bytes, not memory)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> npt.NDArray[np.int64]:
        ids = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        return ids


def replay(trace: Trace, args: argparse.Namespace) -> dict[str, Any]:
    bs = args.block_size
    bpt = K_LAYOUT.kv_bytes_per_token
    p_cache = RadixCache(bs)
    md_cache = RadixCache(bs)
    server = CacheServer(md_cache, epoch=1)
    mirror = CacheMirror(bs, bytes_per_token=bpt)
    ideal = RadixCache(bs)  # unbounded: the trace's intrinsic (infinite-cache) hit rate
    ids = _Ids()
    inflight: deque[tuple[int, list[DrcInserted | DrcEvicted]]] = deque()
    per_hit, per_ideal, per_len = [], [], []
    t_plan = 0.0
    for i, (prompt, output) in enumerate(trace):
        # Events MD published more than `event_lag` requests ago have reached P.
        while inflight and inflight[0][0] <= i - args.event_lag:
            for ev in inflight.popleft()[1]:
                mirror.apply(_wire(ev, "md", "p"))
        full = np.concatenate([prompt, output])
        per_ideal.append(ideal.match_prefix(prompt).num_blocks * bs / prompt.size)
        ideal.insert(full, ids.take(full.size // bs))
        # P prefills with its own prefix cache.
        p_hit = p_cache.match_prefix(prompt).num_blocks * bs
        mirror.record_prefill(p_hit, int(prompt.size))
        p_cache.insert(prompt, ids.take(prompt.size // bs))
        p_cache.evict(len(p_cache) - args.p_capacity)
        # The plan handshake, then the delta lands and MD caches the prompt.
        t0 = time.perf_counter()
        plan, req = mirror.plan(f"r{i}", prompt)
        t_plan += time.perf_counter() - t0
        reply = server.handle_plan(_wire(req, "p", "md"), now=float(i))
        plan = mirror.confirm(plan, _wire(reply, "md", "p"))
        per_hit.append(plan.send_from * bs / prompt.size)
        per_len.append(prompt.size)
        assert plan.plan_id is not None
        server.complete(plan.plan_id, ids.take(plan.full_blocks - plan.send_from))
        # MD decodes; when the request ends, prompt + output join its cache.
        md_cache.insert(full, ids.take(full.size // bs))
        md_cache.evict(len(md_cache) - args.md_capacity)
        inflight.append((i, server.events()))
    stats = mirror.statistics()
    md_stats = md_cache.statistics()
    hit = np.array(per_hit)
    ideal_hit = np.array(per_ideal)
    lens = np.array(per_len)
    without = int(lens.sum()) * bpt
    return {
        "requests": len(trace),
        "tokens": int(lens.sum()),
        "mean_prompt_tokens": float(lens.mean()),
        "trace_mean_hit": float(ideal_hit.mean()),
        "trace_frac_above_95pct": float((ideal_hit > 0.95).mean()),
        "md_mean_hit": float(hit.mean()),
        "md_frac_above_95pct": float((hit > 0.95).mean()),
        "md_hit_rate": stats.bytes_saved / (stats.bytes_saved + stats.bytes_sent),
        "md_hit_rate_blocks": stats.md_hit_rate,
        "p_hit_rate": stats.p_hit_rate,
        "predicted_hit_rate": stats.predicted_hit_rate,
        "overpredicted_blocks": stats.overpredicted_blocks,
        "underpredicted_blocks": stats.underpredicted_blocks,
        "mirror_gaps": stats.gaps,
        "md_evicted_blocks": md_stats.evicted_blocks,
        "md_collisions": md_stats.collisions,
        "wan_bytes_without_drc": without,
        "wan_bytes_with_drc": stats.bytes_sent,
        "wan_bytes_saved": stats.bytes_saved,
        "wan_bytes_ratio": stats.bytes_sent / without,
        "plan_ms_mean": 1e3 * t_plan / len(trace),
        "_hit": hit,
        "_ideal": ideal_hit,
    }


def delta_timing(block_size: int, reps: int) -> dict[str, Any]:
    """Time P's delta for a 128K-token prompt against a mirror holding 95% of it."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 150_000, 128 * 1024)
    mirror = CacheMirror(block_size)
    keys = block_hashes(prompt, block_size)
    held = keys[: int(0.95 * keys.size)].tolist()
    other = rng.integers(0, 2**63, 200_000).tolist()  # the rest of MD's cache

    mirror.apply(DrcInserted(1, 1, held + other))
    delta, plan = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        k = block_hashes(prompt, block_size)
        predicted = mirror.predict(k)
        t1 = time.perf_counter()
        mirror.plan("x", prompt)
        t2 = time.perf_counter()
        delta.append((t1 - t0) * 1e3)
        plan.append((t2 - t1) * 1e3)
    assert predicted == len(held)
    return {"delta_ms": percentiles(delta), "plan_with_request_ms": percentiles(plan)}


def main(args: argparse.Namespace) -> int:
    n = args.requests or (600 if args.quick else 3000)
    t0 = time.perf_counter()
    trace = make_trace(n, sessions=args.sessions, seed=args.seed)
    result = replay(trace, args)
    timing = {
        bs: delta_timing(bs, 15 if args.quick else 50) for bs in sorted({16, args.block_size, 64})
    }
    hit, ideal = result.pop("_hit"), result.pop("_ideal")
    sweep = []
    if not args.quick:
        for cap in (4_000, 12_000, 24_000, 96_000):
            r = replay(trace, argparse.Namespace(**{**vars(args), "md_capacity": cap}))
            sweep.append(
                {
                    "md_capacity_blocks": cap,
                    "md_hit_rate": r["md_hit_rate"],
                    "p_hit_rate": r["p_hit_rate"],
                    "wan_bytes_ratio": r["wan_bytes_ratio"],
                    "overpredicted_blocks": r["overpredicted_blocks"],
                }
            )
        print_table(sweep, title="MD cache capacity sweep")
    rows = [{"metric": k, "value": v} for k, v in result.items() if not k.startswith("_")] + [
        {"metric": f"delta_ms_128k (bs={bs}, p50)", "value": t["delta_ms"]["p50"]}
        for bs, t in timing.items()
    ]
    print_table(rows, title=f"DRC replay: {n} requests, block size {args.block_size}")
    summary = {
        "wan_bytes_ratio_at_90pct_hit": result["wan_bytes_ratio"],
        "trace_mean_hit": result["trace_mean_hit"],
        "delta_ms_128k": timing[16]["delta_ms"]["p50"],
        "trace_frac_above_95pct": result["trace_frac_above_95pct"],
        "md_hit_rate": result["md_hit_rate"],
        "p_hit_rate": result["p_hit_rate"],
        "md_mean_request_hit": result["md_mean_hit"],
        "wan_bytes_without_drc": result["wan_bytes_without_drc"],
        "wan_bytes_with_drc": result["wan_bytes_with_drc"],
        "targets": {"wan_bytes_ratio_at_90pct_hit": "<= 0.12", "delta_ms_128k": "<= 5"},
        "seconds": time.perf_counter() - t0,
    }
    # "90pct" names the trace's design; the hit it really had stands beside the ratio
    head = ("wan_bytes_ratio_at_90pct_hit", "trace_mean_hit", "md_hit_rate", "delta_ms_128k")
    print_table(
        [{**{k: summary[k] for k in head}, "targets": "ratio <= 0.12, delta <= 5 ms"}],
        title="\nheadline (trace_mean_hit: the trace's measured hit with an unbounded cache)",
    )
    write_report(
        args.json,
        summary,
        replay=result,
        delta_timing={str(k): v for k, v in timing.items()},
        config={
            "requests": n,
            "block_size": args.block_size,
            "md_capacity_blocks": args.md_capacity,
            "p_capacity_blocks": args.p_capacity,
            "sessions": args.sessions,
            "event_lag": args.event_lag,
            "seed": args.seed,
            "layout": K_LAYOUT.to_dict(),
        },
        hit_percentiles={"md": percentiles(hit), "trace": percentiles(ideal)},
        capacity_sweep=sweep,
    )
    if args.png:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, h in (("trace (infinite cache)", ideal), ("MD with DRC", hit)):
            xs = np.sort(h)
            ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=name)
        ax.set_xlabel("prefix hit rate of a request")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"WAN bytes with/without DRC: {result['wan_bytes_ratio']:.3f}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png)
    return 0
