"""``pddnet bench recompute`` runs and reports what the issue asks for."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pddnet.bench import recompute


def test_bench_writes_summary(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    recompute.add_arguments(parser)
    out = tmp_path / "r.json"
    args = parser.parse_args(["--quick", "--repeats", "2", "--prefix", "37", "--json", str(out)])
    assert recompute.main(args) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["extend_speedup_100"] > 0  # a speed, not a target: benchmarks hold targets
    assert 0 <= summary["kv_max_rel_err_fp32"] <= 1e-5
    assert summary["greedy_match"] is True
    assert summary["prefix_len"] == 37
