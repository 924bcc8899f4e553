"""``pddnet sim --validate-demo``: the demo's configuration in the simulator, beside the demo.

The simulator is configured from the demo's own values, imported, not
retyped: the link (``pddnet.demo``'s ``--rtt``, ``--rate``, ``--loss``
defaults), the step time, the router's policy and first link estimate as the
demo's P builds them, the decoders' handoff parameters, the WAN sender's
streams and chunk sizes, and the workload (``make_sessions`` with the demo's
seed, sessions, turns and ``max_tokens``: the same prompt lengths). What the
demo's engine costs is *measured* here, on this machine, with the same
reference model (:func:`measure_reference_engine`); nothing is fitted to the
demo's results. docs/sim.md lists the parameters and where the two differ.

Both sides measure TTFT the way the demo does: from the start of the
request's own prefill on P to the first token at P's token sink (the demo's
front end takes its clock when P's event loop runs the session, so a prompt
never waits for another one's prefill in its TTFT).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import PddnetError
from ..demo import add_arguments as demo_arguments
from ..demo import make_sessions
from ..demo import run_config as demo_config
from ..emu import parse_fraction
from ..handoff import HandoffParams
from ..recompute import TINY, ReferenceModel
from ..route import RoutePolicy
from ..transport.wan import K_DEFAULT_BUFFER, K_DEFAULT_CHUNK, Scheduler
from ._config import SimConfig, load_config
from ._models import EngineModel
from ._sim import RunResult, Simulation
from ._workload import Turn, Workload

__all__ = [
    "SimValidationError",
    "compare_with_demo",
    "demo_sim_config",
    "demo_workload",
    "measure_reference_engine",
    "run_demo",
    "simulate_demo",
    "validate_demo",
]

# The demo's decoders plan recomputes at this rate (pddnet/demo/_roles.py,
# serve_decoder's HandoffParams): a literal there, so repeated here.
K_DEMO_RECOMPUTE_RATE = 20000.0
# The demo's P opens its WAN sender with wan_options={"streams": 4} (_roles.prefill).
K_DEMO_WAN_STREAMS = 4
# TCP payload per IP packet at the demo's MTU 1500: 1500 - 20 (IP) - 20 (TCP)
# - 12 (timestamps) = 1448; the emulator shapes IP packets, so goodput is
# rate x 1448 / 1500.
K_MTU = 1500
K_MSS = 1448
# P -> RLD inside DC-A (UCX or TCP over a veth pair, unshaped): 1 GB/s is the
# order of the local path's measured loopback rate (docs/benchmarks.md: pddnet
# 1.01 GB/s over TCP at 16 MiB); a demo prompt's KV (<= 600 KB) takes < 1 ms.
K_LOCAL_BYTES_S = 1e9
K_LOCAL_RTT_S = 1e-4
# The targets of issue 22.
K_TTFT_REL_TARGET = 0.25
K_RLD_SHARE_TARGET = 0.1


class SimValidationError(PddnetError):
    """The demo run behind ``--validate-demo`` failed; ``output`` is its tail."""

    def __init__(self, message: str, *, output: str) -> None:
        super().__init__(f"{message}\n{output}")
        self.output = output


def demo_args(extra: list[str] | None = None) -> argparse.Namespace:
    """``pddnet demo --quick`` (plus ``extra``), parsed by the demo's own parser."""
    parser = argparse.ArgumentParser()
    demo_arguments(parser)
    return parser.parse_args(["--quick", *(extra or [])])


def _tiny_params() -> float:
    """TINY's matmul weights (each costs 2 FLOPs per token): q, k, v, o and
    the SwiGLU MLP per layer, and the LM head."""
    m = TINY
    per_layer = (
        m.hidden * m.qkv_width + m.num_heads * m.head_dim * m.hidden + 3 * m.hidden * m.intermediate
    )
    return float(m.num_layers * per_layer + m.vocab_size * m.hidden)


def _median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_reference_engine(
    prefill_tokens: int = 900, context: int = 900, repeats: int = 7
) -> dict[str, float]:
    """What one pass of the demo's reference model costs on this machine.

    ``per_request_s``: a one-token pass after ``context`` tokens (a decode
    step's cost per request: the reference engine runs each request's pass
    in turn); ``prefill_s``: a cold prefill of ``prefill_tokens`` (the middle
    of the demo's 600-1200-token first prompts); ``flops``: the FLOP rate
    that the rest of the prefill's time implies under the simulator's model
    (2 x params per token plus attention).
    """
    model = ReferenceModel.create(TINY, num_blocks=256)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, TINY.vocab_size, max(prefill_tokens, context)).tolist()

    def prefill() -> None:
        seq = model.new_sequence()
        model.reserve(seq, prefill_tokens)
        model.extend(seq, prompt[:prefill_tokens])
        model.release(seq)

    seq = model.new_sequence()
    model.reserve(seq, context + repeats + 2)
    model.extend(seq, prompt[:context])
    step = _median_s(lambda: model.extend(seq, [1]), repeats)
    model.release(seq)
    full = _median_s(prefill, repeats)
    m = TINY
    flop = (
        2 * _tiny_params() * prefill_tokens
        + 4 * m.num_layers * m.num_heads * m.head_dim * prefill_tokens * prefill_tokens / 2
    )
    return {
        "per_request_s": step,
        "prefill_s": full,
        "prefill_tokens": float(prefill_tokens),
        "flops": flop / max(full - step, 1e-6),
    }


def demo_sim_config(demo: dict[str, Any], measured: dict[str, float]) -> SimConfig:
    """The simulator's configuration for the demo's ``_config`` and a measurement.

    Args:
        demo: the demo's configuration (``pddnet.demo.run_config`` of its arguments).
        measured: :func:`measure_reference_engine`'s result.
    """
    m, step = TINY, demo["step_time_s"]
    kv_per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4  # float32 KV
    weights = _tiny_params() * 4
    block = 16  # ReferenceModel.create's block_size: the demo's KV and DRC block
    cpu = {
        # The per-request cost was measured with its memory traffic: no roofline
        # memory term on top (HBM "infinite").
        "hbm_bytes_s": 1e15,
        "flops": measured["flops"],
        # MD's pool: the demo's blocks, nothing else
        "memory_bytes": weights + demo["blocks"] * block * kv_per_token,
        "price_per_hour": 0.0,
        "per_request_s": measured["per_request_s"],
    }
    policy = RoutePolicy(ttft_target_s=demo["ttft_target_s"], rld_decode_rate=1 / step)
    params = HandoffParams(
        rtt_s=demo["rtt_s"],
        recompute_rate=K_DEMO_RECOMPUTE_RATE,
        catchup_threshold=demo["catchup_threshold"],
    )
    sched = Scheduler(K_DEFAULT_CHUNK)  # as WanSender builds it (its default chunk)
    sessions = demo["sessions"]
    return load_config(
        model={
            "name": "TINY (pddnet.recompute), float32",
            "params": _tiny_params(),
            "layers": m.num_layers,
            "kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim,
            "attn_width": m.num_heads * m.head_dim,
            "dtype_bytes": 4,
        },
        gpu={
            # P's front end prefills on its event loop, unpaced
            "P": {"name": "reference model, P (this CPU)", **cpu},
            # the decoders' ReferenceEngine sleeps step_time_s before each tick
            "D": {"name": "reference model, paced (this CPU)", **cpu, "pace_s": step},
        },
        engine={
            "mfu": 1.0,
            "mbu": 1.0,
            "pass_overhead_s": 0.0,
            # the reference engine steps every running request together
            "md_max_batch": 2 * sessions,
            "rld_max_batch": 2 * sessions,
            "batch_tails": False,
            "memory_reserve": 1.0,
        },
        cluster={
            "prefill": 1,
            "prefill_gpu": "P",
            "relay": 1,
            "relay_gpu": "D",
            "main": 1,
            "main_gpu": "D",
            "kv_block_tokens": block,
            "local_bandwidth_bytes_s": K_LOCAL_BYTES_S,
            "local_rtt_s": K_LOCAL_RTT_S,
            # the demo's baseline runs the same three processes; RLD idles
            "baseline_relay_as": "none",
            "sink": "prefill",  # the demo's user stream is P's token sink
        },
        wan={
            "bandwidth_bps": demo["rate_bps"] * K_MSS / K_MTU,
            "rtt_s": demo["rtt_s"],
            "jitter_s": 0.0,
            "loss": parse_fraction(demo_args().loss),
            "mss_bytes": K_MSS,
            "window_bytes": K_DEFAULT_BUFFER,
            "streams": K_DEMO_WAN_STREAMS,
            "chunk_bytes": sched.chunk_size,
            "min_chunk_bytes": sched.min_chunk,
            "hedge": False,
            "timeout_s": demo["request_timeout_s"],
            # Linux's default, which the demo's hosts keep (it sets no sysctl):
            # a turn's transfer comes ~0.8 s after the last one, past the RTO
            "slow_start_after_idle": True,
            "initial_window_segments": 10,
        },
        router={
            "ttft_target_s": policy.ttft_target_s,
            "md_first_token_s": policy.md_first_token_s,
            "rld_decode_rate": policy.rld_decode_rate,
            "catchup_slack": policy.catchup_slack,
            "max_concurrent_relays": policy.max_concurrent_relays,
            "max_eager_tokens": policy.max_eager_tokens,
            "admission": True,
            "link_estimate": "sampled",
            "md_capacity": 0,  # PrefillEndpoint passes none
            # the demo's P: LinkEstimate(rate_bps / 8, rtt)
            "link_bandwidth_bytes_s": demo["rate_bps"] / 8,
        },
        handoff={
            "mode": params.mode.value,
            "catchup_threshold": params.catchup_threshold,
            "final_switch_size": params.final_switch_size,
            "min_batch": params.min_batch,
            "max_rounds": params.max_rounds,
            "recompute_rate": params.recompute_rate,
            "fallback": params.fallback.value,
            "max_stall_s": params.max_stall_s,
            # RelayEndpoint(cut_off_wan=False), MainEndpoint(keep_strange_traffic=True)
            "keep_strange_traffic": True,
        },
        workload={
            "seed": demo["seed"],
            "sessions": sessions,
            "system_prompt_tokens": 0,  # the demo's prompts share nothing
            "output_max": demo["max_tokens"],
            "max_tokens": demo["max_tokens"],
        },
    )


def demo_workload(demo: dict[str, Any]) -> Workload:
    """The demo's sessions (``make_sessions`` with its seed): every session
    starts at once, each turn right after the previous one, every answer
    ``max_tokens`` long (the reference model has no EOS), and P's prefix
    cache holds the session's previous prompt."""
    sessions = make_sessions(
        demo["seed"],
        demo["sessions"],
        demo["turns"],
        vocab=TINY.vocab_size,
        max_tokens=demo["max_tokens"],
    )
    out = []
    for s, reqs in enumerate(sessions):
        turns, cached = [], 0
        for r in reqs:
            turns.append(Turn(s, r.turn, len(r.prompt), cached, r.max_tokens, 0.0))
            cached = len(r.prompt)
        out.append(turns)
    return Workload(out, 0)


def _phase_metrics(ttfts: list[float], rld: int, md: int) -> dict[str, Any]:
    # as the demo's summary: np.median and np.percentile (linear), in ms
    return {
        "requests": len(ttfts),
        "ttft_p50_ms": float(np.median(ttfts)) * 1e3 if ttfts else math.nan,
        "ttft_p90_ms": float(np.percentile(ttfts, 90)) * 1e3 if ttfts else math.nan,
        "rld_token_share": rld / (rld + md) if rld + md else 0.0,
    }


def _sim_phase(run: RunResult, prefill: EngineModel) -> dict[str, Any]:
    ttfts, low, low_prefill = [], [], []
    for r in run.requests:
        if r.first_token is None or r.prefilled is None:
            ttfts.append(math.inf)
            continue
        own = prefill.prefill_s(r.new_tokens, r.prompt - r.new_tokens)
        # from the start of its own prefill, as the demo's clock
        t = r.first_token - r.prefilled + own
        ttfts.append(t)
        if r.turn == 0:
            low.append(t)
            low_prefill.append(own)
    out = _phase_metrics(
        ttfts, sum(r.rld_tokens for r in run.requests), sum(r.md_tokens for r in run.requests)
    )
    out["ttft_p50_ms_low_hit"] = float(np.median(low)) * 1e3 if low else math.nan
    out["prefill_ms_p50_low_hit"] = float(np.median(low_prefill)) * 1e3 if low else math.nan
    out["failed"] = sum(1 for r in run.requests if r.failure is not None)
    out["relayed"] = sum(1 for r in run.requests if "rld" in r.route)
    out["rounds_total"] = sum(r.rounds for r in run.requests)
    return out


def simulate_demo(demo: dict[str, Any], measured: dict[str, float]) -> dict[str, Any]:
    """Both of the demo's phases in the simulator: TTFT p50/p90 (ms) and RLD's token share."""
    cfg = demo_sim_config(demo, measured)
    workload = demo_workload(demo)
    prefill = EngineModel(cfg.model, cfg.gpu[cfg.cluster.prefill_gpu], cfg.engine)
    out = {}
    for phase in ("pdd", "baseline"):
        run = Simulation(cfg, workload, baseline=phase == "baseline").run()
        out[phase] = _sim_phase(run, prefill)
    return out


def _demo_phase(summary: dict[str, Any], records: list[dict[str, Any]], phase: str) -> dict:
    recs = [r for r in records if r["phase"] == phase]
    ttfts = [min(t[0] for t in r["tokens"]) if r["tokens"] else math.inf for r in recs]
    rld = sum(1 for r in recs for t in r["tokens"] if t[3] == "relay")
    md = sum(1 for r in recs for t in r["tokens"] if t[3] == "main")
    out = _phase_metrics(ttfts, rld, md)
    out["ttft_p50_ms_low_hit"] = summary[f"ttft_p50_ms_low_hit_{phase}"]
    out["failed"] = sum(1 for r in recs if r["outcome"] != "finished")
    out["relayed"] = sum(1 for r in recs if "rld" in r.get("route", ""))
    low = [r["prefill_s"] for r in recs if r["turn"] == 0 and "prefill_s" in r]
    out["prefill_ms_p50_low_hit"] = float(np.median(low)) * 1e3 if low else math.nan
    return out


def compare_with_demo(sim: dict[str, Any], demo_report: dict[str, Any]) -> dict[str, Any]:
    """The simulator's phases beside the demo's (its ``--json`` report), and the errors.

    ``ttft_p50_rel_err`` and ``rld_share_abs_err`` are PDD's (the routed
    phase); the baseline's TTFT error is reported beside them.
    """
    summary, records = demo_report["summary"], demo_report["records"]
    demo = {ph: _demo_phase(summary, records, ph) for ph in ("pdd", "baseline")}
    # the demo's own summary numbers, which the per-record ones must equal
    demo["pdd"]["summary_ttft_p50_ms"] = summary["ttft_p50_ms_all_pdd"]
    demo["pdd"]["summary_rld_token_share"] = summary["rld_token_share"]

    def rel(phase: str, key: str) -> float:
        d = demo[phase][key]
        return (sim[phase][key] - d) / d if d else math.nan

    out = {
        "sim": sim,
        "demo": demo,
        "ttft_p50_rel_err": rel("pdd", "ttft_p50_ms"),
        "ttft_p90_rel_err": rel("pdd", "ttft_p90_ms"),
        "ttft_p50_rel_err_baseline": rel("baseline", "ttft_p50_ms"),
        "ttft_p90_rel_err_baseline": rel("baseline", "ttft_p90_ms"),
        "rld_share_abs_err": abs(sim["pdd"]["rld_token_share"] - demo["pdd"]["rld_token_share"]),
    }
    out["targets_met"] = bool(
        abs(out["ttft_p50_rel_err"]) <= K_TTFT_REL_TARGET
        and out["rld_share_abs_err"] <= K_RLD_SHARE_TARGET
    )
    return out


def run_demo(out: Path, extra: list[str] | None = None, timeout_s: float = 600) -> dict[str, Any]:
    """Run ``python -m pddnet demo --quick`` (plus ``extra``) and read its JSON report.

    Raises:
        SimValidationError: if the demo exits non-zero (its output's tail attached).
    """
    argv = [sys.executable, "-m", "pddnet", "demo", "--quick", "--json", str(out)]
    argv += ["--png", str(out.with_suffix(".png")), *(extra or [])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise SimValidationError(
            f"pddnet demo --quick failed (exit {done.returncode})",
            output=(done.stdout + done.stderr)[-3000:],
        )
    report: dict[str, Any] = json.loads(out.read_text())
    report["link"] = report["summary"].get("link")
    return report


def validate_demo(demo_json: str | None = None) -> dict[str, Any]:
    """The demo's configuration in the simulator, the real demo, and both side by side.

    Args:
        demo_json: a report ``pddnet demo --quick --json`` wrote before; None
            runs the demo now (about 20 s).

    Raises:
        SimValidationError: if the demo run fails.
    """
    demo = demo_config(demo_args())
    with tempfile.TemporaryDirectory() as tmp:
        measured = measure_reference_engine()
        sim = simulate_demo(demo, measured)
        report = (
            json.loads(Path(demo_json).read_text())
            if demo_json
            else run_demo(Path(tmp) / "demo.json")
        )
    out = compare_with_demo(sim, report)
    out["measured"] = measured
    out["demo_config"] = demo
    out["demo_link"] = report["summary"].get("link")
    out["sim_config"] = dataclasses.asdict(demo_sim_config(demo, measured))
    return out
