"""``pddnet bench local``'s cross-host headline (issue 20, item 1).

The paired cross-host rounds are bookkeeping (a fake runner); the real run
puts the receivers in the testbed's ``dc-a-rld`` and the senders in
``dc-a-p`` (the plain TCP server binds ``dc-a-rld``'s address, which exists
only in that namespace) and checks the summary's keys against the rounds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pddnet._optional import available
from pddnet.bench import local
from pddnet.emu import unavailable_reason


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    local.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_crosshost_rounds_run_every_row_in_xhost_mode() -> None:
    calls: list[tuple[str, str]] = []
    times = {"pddnet": 2.0, "raw_ucxx": 3.0, "nixl": 4.0, "tcp": 1.0}

    def run(name: str, mode: str, sizes: list[int], iters: dict[str, int], label: str) -> Any:
        calls.append((name, mode))
        return [{"median_s": times[name] * 1e-6}]

    paired = local._paired_rounds(
        run,
        _args("--quick", "--rounds", "2"),
        16 << 20,
        local.K_CROSSHOST_PAIRED,
        local.K_CROSSHOST_RATIOS,
        "xhost",
    )
    assert {m for _, m in calls} == {"xhost"} and len(calls) == 8
    assert [n for n, _ in calls[4:]] == ["raw_ucxx", "nixl", "tcp", "pddnet"]  # rotated
    out = local.paired_ratios(paired, local.K_CROSSHOST_RATIOS)
    assert out["crosshost_ratio_vs_nixl_16mib"] == pytest.approx(2.0)
    assert out["crosshost_ratio_vs_tcp_16mib"] == pytest.approx(0.5)
    assert out["crosshost_ratio_vs_raw_ucxx_16mib"] == pytest.approx(1.5)
    assert set(out["failed_rounds"]) == set(local.K_CROSSHOST_RATIOS)


@pytest.mark.ucx
@pytest.mark.skipif(not available("ucxx"), reason="ucxx is not installed")
@pytest.mark.skipif(unavailable_reason() is not None, reason="needs network namespaces")
def test_crosshost_run_writes_the_headline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pddnet and one TCP socket across the namespaces: the headline keys, from the rounds."""
    monkeypatch.setattr(local, "K_QUICK_SIZES", [4096, 16 << 20])
    monkeypatch.setattr(local, "_iters", lambda size, quick: 5)
    monkeypatch.setattr(local, "K_PAIRED_ITERS", {True: 5, False: 5})
    out = tmp_path / "local.json"
    only = ("--only", "pddnet", "tcp", "--peer-venv", str(tmp_path / "none"))
    assert local.main(_args("--quick", *only, "--rounds", "2", "--json", str(out))) == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert not report["errors"], report["errors"]
    rows = {(r["impl"], r["mode"]) for r in report["rows"]}
    assert {("pddnet", "xhost"), ("tcp", "xhost"), ("pddnet", "sm")} <= rows
    paired = summary["crosshost_paired_16mib_us"]
    assert set(paired) == {"pddnet", "tcp"} and all(len(v) == 2 for v in paired.values())
    rounds = [t / p for p, t in zip(paired["pddnet"], paired["tcp"], strict=True)]
    assert summary["crosshost_ratio_vs_tcp_16mib_rounds"] == pytest.approx(rounds)
    assert summary["crosshost_ratio_vs_tcp_16mib"] == pytest.approx(float(np.median(rounds)))
    gbps = (16 << 20) / float(np.median(paired["pddnet"])) / 1e3
    assert summary["crosshost_gb_per_s_16mib"] == pytest.approx(gbps)
    assert summary["crosshost_ratio_vs_nixl_16mib"] is None  # NIXL was not run
    one_way = summary["crosshost_one_way_4kib_us"]
    assert one_way["pddnet"] > 0 and one_way["tcp"] > 0
    assert summary["targets"]["crosshost_ratio_vs_nixl_16mib"] == ">= 1.0"
