"""pddnet sim --validate-demo: the simulator half configured from the demo, the comparison."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from pddnet.demo import make_sessions
from pddnet.demo import run_config as demo_config
from pddnet.recompute import TINY
from pddnet.sim._validate import (
    compare_with_demo,
    demo_args,
    demo_sim_config,
    demo_workload,
    measure_reference_engine,
    simulate_demo,
    validate_demo,
)

# A fixed measurement, so the simulated half is exact (measure_reference_engine
# gives this machine's numbers at the time it runs).
MEASURED = {"per_request_s": 3e-4, "prefill_s": 0.022, "prefill_tokens": 900.0, "flops": 2e10}


def test_config_comes_from_the_demos_own_values() -> None:
    demo = demo_config(demo_args())
    cfg = demo_sim_config(demo, MEASURED)
    assert cfg.wan.rtt_s == demo["rtt_s"] == 0.03
    assert cfg.wan.bandwidth_bps == pytest.approx(demo["rate_bps"] * 1448 / 1500)
    assert cfg.router.link_bandwidth_bytes_s == demo["rate_bps"] / 8
    assert cfg.router.ttft_target_s == demo["ttft_target_s"]
    assert cfg.router.rld_decode_rate == 1 / demo["step_time_s"]
    assert cfg.handoff.catchup_threshold == demo["catchup_threshold"]
    assert cfg.gpu["D"].pace_s == demo["step_time_s"] and cfg.gpu["P"].pace_s == 0
    assert cfg.model.kv_bytes_per_token == TINY.kv_layout().block_bytes // 16 == 512
    # the demo's prompts, turn by turn
    w = demo_workload(demo)
    sessions = make_sessions(
        demo["seed"], demo["sessions"], demo["turns"], vocab=TINY.vocab_size, max_tokens=32
    )
    assert [[t.prompt for t in s] for s in w.sessions] == [
        [len(r.prompt) for r in s] for s in sessions
    ]
    assert [t.cached for t in w.sessions[0]] == [0] + [t.prompt for t in w.sessions[0][:-1]]


def test_simulated_demo_relays_the_first_turns_only_and_is_deterministic() -> None:
    demo = demo_config(demo_args())
    a, b = simulate_demo(demo, MEASURED), simulate_demo(demo, MEASURED)
    assert a == b
    pdd, base = a["pdd"], a["baseline"]
    assert pdd["requests"] == base["requests"] == demo["sessions"] * demo["turns"]
    # the low-hit first turns go P->RLD->MD; the later ones find their prefix
    # on MD (kept strange traffic, P's mirror expecting the landed blocks)
    assert (pdd["relayed"], base["relayed"], pdd["failed"], base["failed"]) == (4, 0, 0, 0)
    assert 0 < pdd["rld_token_share"] < 0.5 and base["rld_token_share"] == 0
    # RLD masks the first turns' transfers: their TTFT is P's prefill and a
    # local hop, the baseline's waits for 4 transfers sharing 24 Mbit/s
    assert pdd["ttft_p50_ms_low_hit"] < 0.2 * base["ttft_p50_ms_low_hit"]
    assert pdd["ttft_p50_ms_low_hit"] >= pdd["prefill_ms_p50_low_hit"]


def _record(phase: str, turn: int, first_s: float, sources: list[str]) -> dict[str, Any]:
    tokens = [[first_s + 0.02 * i, i, 7, src] for i, src in enumerate(sources)]
    return {
        "phase": phase,
        "turn": turn,
        "tokens": tokens,
        "outcome": "finished",
        "prefill_s": 0.01,
    }


def test_compare_with_demo_by_hand() -> None:
    # Demo: PDD TTFTs 0.1, 0.2, 0.3, 0.4 s (median 0.25), 4 of 16 tokens from
    # RLD; baseline 0.5 s each.
    recs = [
        _record("pdd", t, 0.1 * (t + 1), ["relay"] * 4 if t == 0 else ["main"] * 4)
        for t in range(4)
    ] + [_record("baseline", t, 0.5, ["main"] * 4) for t in range(4)]
    summary = {
        "ttft_p50_ms_low_hit_pdd": 100.0,
        "ttft_p50_ms_low_hit_baseline": 500.0,
        "ttft_p50_ms_all_pdd": 250.0,
        "rld_token_share": 0.25,
    }
    sim = {
        "pdd": {"ttft_p50_ms": 200.0, "ttft_p90_ms": 330.0, "rld_token_share": 0.3},
        "baseline": {"ttft_p50_ms": 600.0, "ttft_p90_ms": 500.0, "rld_token_share": 0.0},
    }
    out = compare_with_demo(sim, {"summary": summary, "records": recs})
    assert out["demo"]["pdd"]["ttft_p50_ms"] == pytest.approx(250.0)
    assert out["demo"]["pdd"]["ttft_p90_ms"] == pytest.approx(
        float(np.percentile([1, 2, 3, 4], 90)) * 100
    )
    assert out["demo"]["pdd"]["rld_token_share"] == 0.25
    assert out["ttft_p50_rel_err"] == pytest.approx(-0.2)
    assert out["ttft_p50_rel_err_baseline"] == pytest.approx(0.2)
    assert out["rld_share_abs_err"] == pytest.approx(0.05)
    assert out["targets_met"] is True
    sim["pdd"]["ttft_p50_ms"] = 180.0  # -28%: outside 25%
    assert compare_with_demo(sim, {"summary": summary, "records": recs})["targets_met"] is False


def test_measure_reference_engine_gives_positive_rates() -> None:
    m = measure_reference_engine(prefill_tokens=64, context=64, repeats=3)
    assert m["prefill_s"] > m["per_request_s"] > 0 and math.isfinite(m["flops"]) and m["flops"] > 0


@pytest.mark.slow
def test_validate_demo_runs_the_demo_beside_the_simulator() -> None:
    out = validate_demo()  # pddnet demo --quick as a subprocess (about 20 s)
    for phase in ("pdd", "baseline"):
        assert out["demo"][phase]["requests"] == out["sim"][phase]["requests"] == 16
        assert out["demo"][phase]["failed"] == 0
    # the per-record figures are the demo's own summary's
    assert out["demo"]["pdd"]["ttft_p50_ms"] == pytest.approx(
        out["demo"]["pdd"]["summary_ttft_p50_ms"]
    )
    assert out["demo"]["pdd"]["rld_token_share"] == pytest.approx(
        out["demo"]["pdd"]["summary_rld_token_share"]
    )
    assert math.isfinite(out["ttft_p50_rel_err"]) and math.isfinite(out["rld_share_abs_err"])
