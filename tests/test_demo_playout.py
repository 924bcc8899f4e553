"""The demo summary reports what RLD's playout buffer cost (``HandoffParams.playout_s``)."""

from __future__ import annotations

from typing import Any

import pytest

from pddnet import demo


def _record(rid: int, phase: str, times: list[float], src: str) -> dict[str, Any]:
    return {
        "request_id": rid,
        "phase": phase,
        "session": rid,
        "turn": 0,
        "prompt": [1, 2, 3],
        "max_tokens": len(times),
        "outcome": "finished",
        "tokens": [[t, i, 5, src] for i, t in enumerate(times)],
    }


def test_summary_reports_the_playout_cost_per_held_token_and_completion() -> None:
    records = [
        _record(1, "pdd", [0.1, 0.12, 0.15], "relay"),
        _record(2, "pdd", [0.2, 0.22, 0.30], "relay"),
        _record(3, "baseline", [0.3, 0.32, 0.50], "main"),
        _record(4, "baseline", [0.4, 0.42, 0.70], "main"),
    ]
    refs = {r["request_id"]: [5, 5, 5] for r in records}
    relay = [
        {"rounds": 1, "playout_tokens": 2, "playout_total_s": 0.05, "playout_max_s": 0.03},
        {"rounds": 1, "playout_tokens": 1, "playout_total_s": 0.04, "playout_max_s": 0.04},
    ]
    stats = {"pdd": {"relay": {"requests": relay}}}
    s = demo.summarize(records, refs, stats, expected=4)
    assert s["playout_tokens"] == 3
    assert s["playout_share_of_rld_tokens"] == pytest.approx(3 / 6)
    assert s["playout_added_ms_mean"] == pytest.approx(30.0)  # 90 ms over 3 held tokens
    assert s["playout_added_ms_max"] == pytest.approx(40.0)
    assert s["completion_ms_mean_pdd"] == pytest.approx(225.0)
    assert s["completion_ms_mean_baseline"] == pytest.approx(600.0)
    # no playout (or an older RLD's statistics without the fields): zeros, not errors
    s = demo.summarize(records, refs, {"pdd": {"relay": {"requests": [{"rounds": 1}]}}}, expected=4)
    assert s["playout_tokens"] == 0 and s["playout_added_ms_mean"] == 0.0
    assert s["playout_added_ms_max"] == 0.0
