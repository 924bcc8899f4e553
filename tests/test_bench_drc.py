"""``pddnet bench drc``: the headline table shows the hit rate the trace really had."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pddnet.bench import drc


def test_headline_table_prints_the_measured_hit_beside_the_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    drc.add_arguments(parser)
    out = tmp_path / "drc.json"
    # a short trace: its hit is well under the 90 % the key's name suggests
    assert drc.main(parser.parse_args(["--quick", "--requests", "60", "--json", str(out)])) == 0
    summary = json.loads(out.read_text())["summary"]
    lines = capsys.readouterr().out.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("wan_bytes_ratio_at_90pct_hit"))
    cols, values = lines[i].split(), lines[i + 2].split()
    row = dict(zip(cols, values, strict=False))
    assert float(row["trace_mean_hit"]) == pytest.approx(summary["trace_mean_hit"], rel=1e-3)
    assert float(row["wan_bytes_ratio_at_90pct_hit"]) == pytest.approx(
        summary["wan_bytes_ratio_at_90pct_hit"], rel=1e-3
    )
    assert summary["trace_mean_hit"] < 0.9  # so the printed figure is the one that matters
