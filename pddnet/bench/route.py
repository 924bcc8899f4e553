"""Routing across a cluster: the etcd directory's failover time.

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
from typing import Any

import trio

from ..directory import EtcdServer, find_etcd, measure_failover
from ..directory._server import K_ETCD_HINT
from ._common import add_common_arguments, percentiles, print_table, write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, png=False)
    parser.add_argument(
        "--etcd", metavar="URL", help="an etcd client URL to measure on (default: a throwaway one)"
    )
    parser.add_argument(
        "--ttl", type=int, default=2, help="lease TTL, seconds (default 2: etcd's default minimum)"
    )
    parser.add_argument("--reps", type=int, help="failovers to measure (default 3 quick, 10 full)")


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
    summary, details = failover(args)
    write_report(args.json, summary, **details)
    return 0
