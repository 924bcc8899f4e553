"""Metrics of a run, the baseline-vs-PDD comparison, sweeps and their plot."""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from ._config import SimConfig
from ._sim import RunResult, Simulation
from ._workload import Workload

__all__ = ["SOURCE_RESULTS", "compare", "run_metrics", "run_pair", "sweep"]

# The PDD source's system results (/work/shared/PDD-BRIEF.md), for the side-by-side table.
SOURCE_RESULTS = {
    "ttft_p50_reduction": 0.515,
    "goodput_gain": 0.278,
    "bcr_gain": 0.375,
    "hardware_cost_change": "-3.5% to -7.1%",
    "rld_token_share": 0.062,
    "md_rld_token_ratio": 15.2,
    "gpus": "43 type A (P, RLD) + 32 type B (MD)",
}


def _pct(values: Sequence[float], q: float) -> float:
    # no interpolation: a failed request's infinite TTFT must not turn a percentile into nan
    if not values:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=float), q, method="inverted_cdf"))


def run_metrics(run: RunResult, cfg: SimConfig) -> dict[str, Any]:
    """The metrics of one run (times in seconds; failed requests count as
    infinitely late in TTFT percentiles and never meet the SLA)."""
    reqs = run.requests
    ttft = [r.ttft if r.ttft is not None and r.failure is None else math.inf for r in reqs]
    tpot = [r.tpot for r in reqs if r.tpot is not None]
    sla = cfg.sla
    good = sum(
        1
        for r in reqs
        if r.failure is None
        and r.ttft is not None
        and r.ttft <= sla.ttft_s
        and (r.tpot or 0.0) <= sla.tpot_s
    )
    rld = sum(r.rld_tokens for r in reqs)
    md = sum(r.md_tokens for r in reqs)
    span = max(run.makespan_s, 1e-9)
    goodput = good / span
    stalls = [r.handoff_stall_s for r in reqs if r.handoff_stall_s is not None]
    busy = {role: run.busy_s[role] / (n * span) if n else 0.0 for role, n in run.gpus.items()}
    per_gpu = {
        "relay": rld / run.gpus["relay"] if run.gpus["relay"] else 0.0,
        "main": md / run.gpus["main"],
    }
    return {
        "requests": len(reqs),
        "failed": sum(1 for r in reqs if r.failure is not None),
        "makespan_s": run.makespan_s,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50),
        "tpot_p99_s": _pct(tpot, 99),
        "sla_met": good / len(reqs) if reqs else 0.0,
        "goodput_rps": goodput,
        "rld_token_share": rld / (rld + md) if rld + md else 0.0,
        "md_rld_token_ratio": md / rld if rld else math.inf,
        "md_rld_tokens_per_gpu_ratio": per_gpu["main"] / per_gpu["relay"]
        if per_gpu["relay"]
        else math.inf,
        "busy": busy,
        "handoffs": len(stalls),
        "handoff_stall_p99_s": _pct(stalls, 99),
        "wan_bytes": run.wan_bytes,
        "wan_bytes_resent": run.wan_bytes_resent,
        "md_cache_hit_rate": run.md_cache_hit_rate,
        "mirror_overpredicted_blocks": run.mirror_overpredicted_blocks,
        "gpus": run.gpus,
        "cost_per_hour": run.cost_per_hour,
        "bcr": goodput / run.cost_per_hour if run.cost_per_hour else 0.0,
        "routes": run.router["by_route"],
        "reasons": run.router["by_reason"],
        "events": run.events,
    }


def _ratio(new: float, old: float) -> float:
    return new / old - 1.0 if old and math.isfinite(old) else math.nan


def _reduction(new: float, old: float) -> float:
    return 1.0 - new / old if old and math.isfinite(old) and math.isfinite(new) else math.nan


def compare(base: dict[str, Any], pdd: dict[str, Any]) -> dict[str, Any]:
    """PDD's gains over the baseline (reductions and gains are fractions)."""
    return {
        "ttft_p50_reduction": _reduction(pdd["ttft_p50_s"], base["ttft_p50_s"]),
        "ttft_p90_reduction": _reduction(pdd["ttft_p90_s"], base["ttft_p90_s"]),
        "ttft_p99_reduction": _reduction(pdd["ttft_p99_s"], base["ttft_p99_s"]),
        "goodput_gain": _ratio(pdd["goodput_rps"], base["goodput_rps"]),
        "hardware_cost_change": _ratio(pdd["cost_per_hour"], base["cost_per_hour"]),
        "bcr_gain": _ratio(pdd["bcr"], base["bcr"]),
        "rld_token_share": pdd["rld_token_share"],
        "md_rld_token_ratio": pdd["md_rld_token_ratio"],
        "wan_bytes_change": _ratio(pdd["wan_bytes"], base["wan_bytes"]),
    }


def workload_for(cfg: SimConfig, sessions: int | None = None) -> Workload:
    """The configured workload: the trace if one is named, else the generator."""
    if cfg.workload.trace:
        return Workload.from_trace(cfg.workload.trace, cfg.workload)
    return Workload.generate(cfg.workload, sessions)


def default_jobs() -> int:
    """Processes for a pair of runs: two where the machine has two CPUs."""
    return min(2, os.cpu_count() or 1)


def _run_one(cfg: SimConfig, workload: Workload, mode: str) -> tuple[dict[str, Any], float]:
    """One run's metrics and the CPU seconds it took (in whichever process runs it)."""
    c0 = time.process_time()
    result = Simulation(cfg, workload, baseline=mode == "baseline").run()
    return run_metrics(result, cfg), time.process_time() - c0


def run_pair(
    cfg: SimConfig,
    workload: Workload,
    *,
    progress: Callable[[str], None] | None = None,
    jobs: int | None = None,
) -> dict[str, Any]:
    """Baseline and PDD on the same workload and cluster: both runs' metrics,
    the comparison, and the simulator's own speed.

    Args:
        cfg: the configuration.
        workload: the sessions both runs serve.
        progress: called with a line as each run starts.
        jobs: 2 runs the two in two forked processes at once (each run is
            deterministic and independent of the other, so the results are
            those of running them one after the other, which ``jobs=1``
            does in this process); default :func:`default_jobs`.
    """
    modes = ("baseline", "pdd")
    t0 = time.perf_counter()
    if progress:
        for mode in modes:
            progress(f"sim: {mode}: {workload.requests} requests")
    if (jobs or default_jobs()) >= 2:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=2, mp_context=ctx) as pool:
            futures = [pool.submit(_run_one, cfg, workload, mode) for mode in modes]
            done = [f.result() for f in futures]
    else:
        done = [_run_one(cfg, workload, mode) for mode in modes]
    runs = {mode: metrics for mode, (metrics, _) in zip(modes, done, strict=True)}
    wall, cpu = time.perf_counter() - t0, sum(c for _, c in done)
    summary = compare(runs["baseline"], runs["pdd"])
    simulated = runs["baseline"]["requests"] + runs["pdd"]["requests"]
    summary.update(
        requests_simulated=runs["pdd"]["requests"],
        runs=2,
        jobs=jobs or default_jobs(),
        wall_s=wall,
        cpu_s=cpu,
        sim_requests_per_s=simulated / wall if wall > 0 else math.inf,
        sim_requests_per_cpu_s=simulated / cpu if cpu > 0 else math.inf,
        mean_prefix_hit=workload.mean_hit(),
        share_hit_above_95=workload.share_above(0.95),
        gpus=sum(runs["pdd"]["gpus"].values()),
    )
    return {"summary": summary, "baseline": runs["baseline"], "pdd": runs["pdd"]}


def sweep(
    cfg: SimConfig,
    kind: str,
    sessions: int,
    *,
    progress: Callable[[str], None] | None = None,
    jobs: int | None = None,
) -> list[dict[str, Any]]:
    """Run baseline and PDD at each point of a sweep.

    ``hit-rate``: every turn after a session's first hits about ``h`` (no
    low-hit turns), for ``h`` from 0.1 to 0.99; ``rld-count``: the number of
    RLD GPUs; ``wan-gbps``: the WAN's bandwidth; ``admission``: RLD admission
    control on and off.
    """
    points: list[tuple[Any, SimConfig]] = []
    if kind == "hit-rate":
        for h in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99):
            c = cfg.replace(
                "workload",
                low_hit_fraction=0.0,
                high_hit_min=max(0.0, h - 0.02),
                high_hit_max=min(0.995, h + 0.02),
            )
            points.append((h, c))
    elif kind == "rld-count":
        for n in (1, 2, 4, 8, 12, 16):
            points.append((n, cfg.replace("cluster", relay=n)))
    elif kind == "wan-gbps":
        for gbps in (10, 25, 40, 50, 70, 100, 200):
            points.append((gbps, cfg.replace("wan", bandwidth_bps=gbps * 1e9)))
    elif kind == "admission":
        for on in (True, False):
            points.append((on, cfg.replace("router", admission=on)))
    else:
        raise ValueError(f"unknown sweep {kind!r}")
    out = []
    for value, c in points:
        w = workload_for(c, sessions)
        res = run_pair(c, w, progress=progress, jobs=jobs)
        out.append({"point": value, **res})
        if progress:
            s = res["summary"]
            progress(
                f"sim: {kind}={value}: hit {s['mean_prefix_hit']:.3f}, TTFT p50 "
                f"{-s['ttft_p50_reduction']:+.1%}, goodput {s['goodput_gain']:+.1%}"
            )
    return out


def plot_sweep(points: list[dict[str, Any]], kind: str, path: str) -> None:
    """Draw a sweep (x: measured mean prefix hit, or the swept value) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if kind == "hit-rate":
        xs = [p["summary"]["mean_prefix_hit"] for p in points]
        xlabel = "mean prefix hit rate (measured over the workload)"
    else:
        xs = [float(p["point"]) for p in points]
        xlabel = kind
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    ax1.plot(xs, [p["summary"]["goodput_gain"] for p in points], "o-", label="goodput gain")
    ax1.plot(xs, [p["summary"]["bcr_gain"] for p in points], "s--", label="BCR gain")
    ax1.plot(
        xs, [p["summary"]["ttft_p50_reduction"] for p in points], "^-", label="TTFT p50 reduction"
    )
    ax1.axhline(0, color="grey", lw=0.5)
    ax1.set_yscale("symlog", linthresh=1.0)  # a collapsed baseline makes gains of 10-100x
    ax1.set_ylabel("PDD vs baseline (fraction)")
    ax1.legend(loc="best", fontsize=8)
    ax2.plot(xs, [p["pdd"]["goodput_rps"] for p in points], "o-", label="PDD goodput")
    ax2.plot(xs, [p["baseline"]["goodput_rps"] for p in points], "s--", label="baseline goodput")
    ax2.set_ylabel("requests/s within the SLA")
    ax2.set_xlabel(xlabel)
    ax2.legend(loc="best", fontsize=8)
    fig.suptitle(f"pddnet sim --sweep {kind}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
