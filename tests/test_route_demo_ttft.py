"""The demo summary's TTFT over all requests (issue 21): mean, p90 and p99 of
each phase, and how much routing cuts each, from known first-token times."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pddnet import demo


def _record(rid: int, phase: str, turn: int, ttft_s: float) -> dict[str, Any]:
    return {
        "request_id": rid,
        "phase": phase,
        "session": rid,
        "turn": turn,
        "prompt": [1, 2, 3],
        "max_tokens": 2,
        "tokens": [[ttft_s, 0, 7, "main"], [ttft_s + 0.02, 1, 8, "main"]],
        "outcome": "finished",
    }


def test_ttft_mean_p90_p99_over_all_requests_and_their_reductions() -> None:
    pdd = [0.01, 0.1, 0.1, 0.1, 0.2]  # seconds; turn 0 is the first entry
    base = [1.0, 0.1, 0.1, 0.2, 0.4]
    records = [_record(i, "pdd", int(i > 0), t) for i, t in enumerate(pdd)]
    records += [_record(10 + i, "baseline", int(i > 0), t) for i, t in enumerate(base)]
    refs = {rec["request_id"]: [7, 8] for rec in records}
    s = demo.summarize(records, refs, {}, expected=len(records))
    assert s["tokens_match_reference"] is True
    pdd_ms, base_ms = np.array(pdd) * 1e3, np.array(base) * 1e3
    for stat, fn in (
        ("mean", np.mean),
        ("p90", lambda v: np.percentile(v, 90)),
        ("p99", lambda v: np.percentile(v, 99)),
    ):
        assert s[f"ttft_{stat}_ms_all_pdd"] == pytest.approx(fn(pdd_ms))
        assert s[f"ttft_{stat}_ms_all_baseline"] == pytest.approx(fn(base_ms))
        assert s[f"ttft_{stat}_reduction"] == pytest.approx(1 - fn(pdd_ms) / fn(base_ms))
    assert s["ttft_mean_reduction"] == pytest.approx(1 - 102 / 360)
    assert s["ttft_p50_ms_all_pdd"] == pytest.approx(100) and s["ttft_p50_ms_all_baseline"] == (
        pytest.approx(200)
    )
    assert s["ttft_p50_reduction_low_hit"] == pytest.approx(0.99)
