"""``pddnet bench local``: the paired 16 MiB rounds, and one tiny real run.

The paired rounds are pure bookkeeping (a fake runner checks the order and
the shape); the real run moves data between two processes over ucxx and
checks only sizes and sanity: speed targets belong to the benchmark's report.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from pddnet._optional import available
from pddnet.bench import local


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    local.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_paired_rounds_rotate_the_order_and_keep_failures_out() -> None:
    calls: list[str] = []

    def run(name: str, mode: str, sizes: list[int], iters: dict[str, int]) -> list[dict[str, Any]]:
        assert mode == "sm" and sizes == [16 << 20] and iters == {str(16 << 20): 20}
        calls.append(name)
        if name == "nixl":  # a peer that cannot run: no result, no ratio
            return []
        return [{"median_s": {"pddnet": 1e-3, "raw_ucxx": 0.9e-3}[name]}]

    out = local._paired_rounds(run, _args("--quick", "--rounds", "3"), 16 << 20)
    assert calls == [
        *("pddnet", "raw_ucxx", "nixl"),
        *("raw_ucxx", "nixl", "pddnet"),
        *("nixl", "pddnet", "raw_ucxx"),
    ]
    assert out["pddnet"] == pytest.approx([1000.0] * 3)
    assert out["raw_ucxx"] == pytest.approx([900.0] * 3)
    assert out["nixl"] == [0.0] * 3


def test_paired_rounds_need_pddnet_and_a_peer() -> None:
    def run(*_: Any) -> list[dict[str, Any]]:
        raise AssertionError("nothing should run")

    assert local._paired_rounds(run, _args("--only", "pddnet", "tcp"), 1) == {}
    assert local._paired_rounds(run, _args("--only", "raw_ucxx", "nixl"), 1) == {}
    assert local._paired_rounds(run, _args("--rounds", "0"), 1) == {}


@pytest.mark.ucx
@pytest.mark.skipif(not available("ucxx"), reason="ucxx is not installed")
def test_quick_run_against_raw_ucxx(tmp_path: Path) -> None:
    out = tmp_path / "local.json"
    args = _args("--quick", "--only", "pddnet", "raw_ucxx", "--rounds", "2", "--json", str(out))
    assert local.main(args) == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert report["errors"] == {}
    rows = {(r["impl"], r["mode"], r["size"]) for r in report["rows"]}
    assert rows == {
        (impl, mode, size)
        for impl in ("pddnet", "raw_ucxx")
        for mode in ("sm", "tcp")
        for size in local.K_QUICK_SIZES
    }
    paired = summary["paired_16mib_us"]
    assert set(paired) == {"pddnet", "raw_ucxx"}
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in paired.values())
    rounds = summary["ratio_vs_raw_ucxx_16mib_rounds"]
    assert rounds == pytest.approx(
        [r / p for p, r in zip(paired["pddnet"], paired["raw_ucxx"], strict=True)]
    )
    assert summary["ratio_vs_raw_ucxx_16mib"] == pytest.approx(
        sorted(rounds)[0] / 2 + sorted(rounds)[1] / 2
    )
    assert summary["ratio_vs_nixl_16mib"] is None and summary["nixl_error"] == "not run"
