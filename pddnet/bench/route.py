"""Routing across a cluster: the router's decision rate and the etcd
directory's failover time.

``decisions_per_s``: routing decisions a second for 4 RLD x 8 MD with
10,000 cached prefixes (:func:`decision_rate`): per request, the prediction
of each MD's mirror of its cache (binary search of the prompt's chain keys),
each MD's WAN scheduler's bytes ahead of that delta, and
:meth:`~pddnet.route.Router.decide` with every candidate (admission, the
record of each verdict); RLD slots are released 32 decisions later. The
prompt's chain hash, which P computes once per prompt whatever it routes, is
measured apart (``chain_hash_us_mean``). The summary's figure is the median
of the repetitions' wall-clock rates; ``decisions_per_cpu_s`` divides by the
process's CPU time instead (what the rate would be with a core to itself, on
a machine other processes load).

``failover_s``: how long after an instance dies the directory reports it gone
(:func:`pddnet.directory.measure_failover`): a child process registers a
``main`` member under a lease and keeps it alive, is killed with SIGKILL once
a watcher has seen it join (just after its lease was granted: the whole TTL
remains), and the time to the watcher's leave event is one sample: the lease
TTL plus detection (etcd's expiry check, every 500 ms, and the watch's
delivery). The summary's ``failover_s`` is the largest sample (what a
router must allow for), ``failover_s_p50`` the median. Without ``--etcd`` it
runs a throwaway etcd on loopback (Debian's ``etcd-server``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from typing import Any

import numpy as np
import trio

from ..cache import CacheMirror, DrcInserted, block_hashes
from ..directory import EtcdServer, find_etcd, measure_failover
from ..directory._server import K_ETCD_HINT
from ..route import LinkEstimate, MainCandidate, RelayCandidate, RoutePolicy, Router, RouteRequest
from ..transport.wan._scheduler import Scheduler
from ._common import add_common_arguments, percentiles, print_table, write_report

K_BLOCK = 16  # tokens per block
K_BLOCK_BYTES = K_BLOCK * 128 << 10  # a 7B-class model's KV: 128 KiB per token


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, png=False)
    parser.add_argument(
        "--etcd", metavar="URL", help="an etcd client URL to measure on (default: a throwaway one)"
    )
    parser.add_argument(
        "--ttl", type=int, default=2, help="lease TTL, seconds (default 2: etcd's default minimum)"
    )
    parser.add_argument("--reps", type=int, help="failovers to measure (default 3 quick, 10 full)")
    parser.add_argument(
        "--decisions", type=int, help="routing decisions per repetition (default 20k quick, 100k)"
    )


def _cluster(
    rng: np.random.Generator, mains: int, prefixes: int
) -> tuple[list[CacheMirror], list[np.ndarray], list[int]]:
    """``mains`` mirrors holding ``prefixes`` cached prompts between them
    (each on one MD, a tenth on a second), the prompts' tokens and homes."""
    mirrors = [CacheMirror(K_BLOCK) for _ in range(mains)]
    prompts, homes = [], []
    for i in range(prefixes):
        toks = rng.integers(0, 32000, int(rng.integers(256, 2048)))
        keys = [int(k) for k in block_hashes(toks, K_BLOCK)]
        home = i % mains
        for m in {home, int(rng.integers(mains))} if i % 10 == 0 else {home}:
            mirrors[m].apply(DrcInserted(1, mirrors[m].seq + 1, keys))
        prompts.append(toks)
        homes.append(home)
    return mirrors, prompts, homes


def _queues(rng: np.random.Generator, mains: int) -> list[Scheduler]:
    """Each MD's WAN scheduler with 0-4 transfers running, some chunks on a socket."""
    out = []
    for _ in range(mains):
        s = Scheduler()
        for tid in range(int(rng.integers(0, 5))):
            size = int(rng.integers(1, 64)) * K_BLOCK_BYTES
            s.add_transfer(tid, size)
            s.mark_ready(tid, 0, size)
        for stream in range(int(rng.integers(0, 4))):
            s.next_chunk(stream, 0.0)
        out.append(s)
    return out


def decision_rate(
    *,
    relays: int = 4,
    mains: int = 8,
    prefixes: int = 10_000,
    decisions: int,
    reps: int,
    seed: int = 1,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(summary fields, one row per repetition) of the routing-decision rate."""
    rng = np.random.default_rng(seed)
    mirrors, prompts, _ = _cluster(rng, mains, prefixes)
    queues = _queues(rng, mains)
    names = [f"md{i}" for i in range(mains)]
    rlds = tuple(RelayCandidate(f"rld{i}") for i in range(relays))
    # requests: 80% a cached prompt plus a turn (high hit), 20% a new prompt
    reqs = []
    for _ in range(min(decisions, 20_000)):
        if rng.random() < 0.8:
            base = prompts[int(rng.integers(len(prompts)))]
            toks = np.concatenate([base, rng.integers(0, 32000, int(rng.integers(16, 48)))])
        else:
            toks = rng.integers(0, 32000, int(rng.integers(256, 2048)))
        reqs.append(toks)
    t = time.perf_counter()
    keyed = [(block_hashes(toks, K_BLOCK).tolist(), -(-toks.size // K_BLOCK)) for toks in reqs]
    hash_us = 1e6 * (time.perf_counter() - t) / len(reqs)
    rows = []
    for rep in range(reps):
        router = Router(
            RoutePolicy(ttft_target_s=0.15, max_concurrent_relays=8),
            LinkEstimate(bandwidth_bytes_s=1.25e9, rtt_s=0.03),
        )
        held: deque[int] = deque()
        t0, c0 = time.perf_counter(), time.process_time()
        for rid in range(decisions):
            keys, nblocks = keyed[rid % len(keyed)]
            cands = []
            for name, mirror, sched in zip(names, mirrors, queues, strict=True):
                delta = (nblocks - mirror.predict(keys)) * K_BLOCK_BYTES
                cands.append(MainCandidate(name, delta, sched.bytes_ahead(delta)))
            d = router.decide(RouteRequest(rid, 0, 256, mains=tuple(cands), relays=rlds), 0.0)
            if d.uses_rld:
                held.append(rid)
            while held and held[0] <= rid - 32:  # RLD lets go 32 decisions later
                router.release(held.popleft())
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        st = router.statistics()
        rows.append(
            {
                "rep": rep,
                "decisions": decisions,
                "elapsed_s": elapsed,
                "decisions_per_s": decisions / elapsed,
                "decisions_per_cpu_s": decisions / cpu,
                "p_md": st.by_route.get("p-md", 0),
                "p_rld_md": st.by_route.get("p-rld-md", 0),
                "mds_used": len(st.by_main),
            }
        )
    rates = [r["decisions_per_s"] for r in rows]
    print_table(
        rows, title=f"routing decisions: {relays} RLD x {mains} MD, {prefixes} cached prefixes"
    )
    summary = {
        "decisions_per_s": float(np.median(rates)),
        "decisions_per_s_min": min(rates),
        "decisions_per_cpu_s": float(np.median([r["decisions_per_cpu_s"] for r in rows])),
        "chain_hash_us_mean": hash_us,
        "route_relays": relays,
        "route_mains": mains,
        "cached_prefixes": prefixes,
        "cached_keys": sum(len(m) for m in mirrors),
    }
    return summary, rows


async def _failovers(url: str, ttl: int, reps: int) -> list[Any]:
    return [await measure_failover(url, ttl=ttl) for _ in range(reps)]


def failover(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(summary fields, details) of the failover measurement; ``failover_s``
    None and ``missing`` set when there is no etcd to run."""
    reps = args.reps or (3 if args.quick else 10)
    server = None
    if args.etcd:
        url = args.etcd
    elif find_etcd() is None:
        print(f"etcd missing: {K_ETCD_HINT}; failover_s is not measured", file=sys.stderr)
        return {"failover_s": None, "missing": {"etcd": K_ETCD_HINT}}, {}
    else:
        server = EtcdServer()
        url = server.__enter__()
    try:
        samples = trio.run(_failovers, url, args.ttl, reps)
    finally:
        if server is not None:
            server.close()
    times = [s.failover_s for s in samples]
    st = percentiles(times)
    rows = [
        {"rep": i, "lease_ttl_s": s.lease_ttl, "failover_s": s.failover_s, "join_s": s.join_s}
        for i, s in enumerate(samples)
    ]
    print_table(rows, title=f"directory failover on etcd ({'throwaway' if server else url})")
    summary = {
        "failover_s": st["max"],
        "failover_s_p50": st["p50"],
        "lease_ttl_s": max(s.lease_ttl for s in samples),
        "failover_reps": reps,
    }
    return summary, {"failover_samples": rows, "failover_s": st}


def main(args: argparse.Namespace) -> int:
    rate, rows = decision_rate(
        decisions=args.decisions or (20_000 if args.quick else 100_000),
        reps=3 if args.quick else 5,
    )
    summary, details = failover(args)
    write_report(args.json, {**rate, **summary}, decision_reps=rows, **details)
    return 0
