"""``pddnet sim``: baseline (all P->MD) against PDD on a simulated cluster."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from ._config import load_config
from ._report import SOURCE_RESULTS, plot_sweep, run_pair, sweep, workload_for

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a TOML file overriding pddnet/sim/default.toml")
    p.add_argument("--quick", action="store_true", help="the [quick] session count (under 60 s)")
    p.add_argument("--sessions", type=int, help="sessions to generate (overrides the config)")
    p.add_argument("--seed", type=int, help="the workload's seed (overrides the config)")
    p.add_argument("--json", metavar="F", help="write the results as JSON to F")
    p.add_argument(
        "--sweep",
        choices=("hit-rate", "rld-count", "wan-gbps", "admission"),
        help="run baseline and PDD at each point of a sweep",
    )
    p.add_argument("--png", metavar="F", help="with --sweep: plot it to F")
    p.add_argument(
        "--validate-demo",
        action="store_true",
        help="run the demo's configuration in the simulator and run pddnet demo --quick, and"
        " report both side by side (ttft_p50_rel_err, rld_share_abs_err)",
    )
    p.add_argument(
        "--demo-json",
        metavar="F",
        help="with --validate-demo: compare with this pddnet demo --quick --json report"
        " instead of running the demo",
    )
    p.add_argument(
        "--jobs",
        type=int,
        choices=(1, 2),
        help="2: the baseline and PDD runs in two processes at once (the default on two or"
        " more CPUs); 1: one after the other in this process",
    )


def _clean(obj: Any) -> Any:
    """JSON has no inf/nan: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _validate(args: argparse.Namespace) -> int:
    from ._validate import validate_demo  # imports the demo (and its engines) only here

    res = validate_demo(args.demo_json)
    print(f"pddnet sim --validate-demo: the demo's link: {res['demo_link']}")
    print(f"{'':26} {'sim pdd':>9} {'demo pdd':>9} {'sim base':>9} {'demo base':>9}")
    sim, demo = res["sim"], res["demo"]
    for key, label in (
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("ttft_p90_ms", "TTFT p90 ms"),
        ("ttft_p50_ms_low_hit", "TTFT p50 ms, first turns"),
        ("prefill_ms_p50_low_hit", "P prefill ms, first turns"),
        ("rld_token_share", "RLD token share"),
        ("relayed", "requests relayed"),
        ("failed", "failed"),
    ):
        row = [sim["pdd"][key], demo["pdd"][key], sim["baseline"][key], demo["baseline"][key]]
        print(f"{label:26} " + " ".join(f"{v:9.4g}" for v in row))
    print(
        f"ttft_p50_rel_err {res['ttft_p50_rel_err']:+.3f} (target within 0.25), "
        f"rld_share_abs_err {res['rld_share_abs_err']:.3f} (target 0.1); baseline's TTFT p50 "
        f"{res['ttft_p50_rel_err_baseline']:+.3f}; targets met: {res['targets_met']}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_clean(res), f, indent=1, default=str)
    return 0


def main(args: argparse.Namespace) -> int:
    if args.validate_demo:
        return _validate(args)
    over: dict[str, dict[str, Any]] = {}
    if args.seed is not None:
        over.setdefault("workload", {})["seed"] = args.seed
    cfg = load_config(args.config, **over)
    sessions = args.sessions or (cfg.quick.sessions if args.quick else cfg.workload.sessions)
    out: dict[str, Any] = {"config": list(cfg.source), "source": SOURCE_RESULTS}
    if args.sweep:
        points = sweep(cfg, args.sweep, sessions, progress=_progress, jobs=args.jobs)
        out["sweep"] = args.sweep
        out["points"] = points
        if args.png:
            plot_sweep(points, args.sweep, args.png)
        rows = [(p["point"], p["summary"]) for p in points]
        print(
            f"{'point':>8} {'hit':>6} {'ttft50 red':>10} {'goodput':>8} {'bcr':>8} {'rld share':>9}"
        )
        for point, s in rows:
            print(
                f"{point!s:>8} {s['mean_prefix_hit']:6.3f} {-s['ttft_p50_reduction']:+10.1%} "
                f"{s['goodput_gain']:+8.1%} {s['bcr_gain']:+8.1%} {s['rld_token_share']:9.3f}"
            )
    else:
        res = run_pair(cfg, workload_for(cfg, sessions), progress=_progress, jobs=args.jobs)
        out.update(res)
        s, b, d = res["summary"], res["baseline"], res["pdd"]
        print(f"{'':24} {'baseline':>10} {'pdd':>10}   source (PDD vs its baseline)")
        for key, label in (
            ("ttft_p50_s", "TTFT p50 s"),
            ("ttft_p90_s", "TTFT p90 s"),
            ("ttft_p99_s", "TTFT p99 s"),
            ("goodput_rps", "goodput req/s (SLA)"),
            ("cost_per_hour", "hardware $/h"),
            ("bcr", "BCR"),
            ("rld_token_share", "RLD token share"),
            ("wan_bytes", "WAN bytes"),
        ):
            print(f"{label:24} {b[key]:10.4g} {d[key]:10.4g}")
        print(
            f"PDD vs baseline: TTFT p50 {-s['ttft_p50_reduction']:+.1%} (source -51.5%), p99 "
            f"{-s['ttft_p99_reduction']:+.1%}; goodput {s['goodput_gain']:+.1%} (source +27.8%); "
            f"BCR {s['bcr_gain']:+.1%} (source +37.5%); RLD share {s['rld_token_share']:.3f} "
            f"(source 0.062)"
        )
        print(
            f"{s['requests_simulated']} requests x {s['runs']} runs on {s['gpus']} GPUs in "
            f"{s['wall_s']:.1f} s ({s['cpu_s']:.1f} s of CPU): {s['sim_requests_per_s']:.0f} "
            f"simulated requests/s ({s['sim_requests_per_cpu_s']:.0f} per CPU second)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_clean(out), f, indent=1)
    return 0
