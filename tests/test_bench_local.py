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


def test_paired_rounds_rotate_the_order_and_mark_failures() -> None:
    calls: list[tuple[str, str]] = []

    def run(
        name: str, mode: str, sizes: list[int], iters: dict[str, int], label: str
    ) -> list[dict[str, Any]]:
        assert mode == "sm" and sizes == [16 << 20] and iters == {str(16 << 20): 20}
        calls.append((name, label))
        if name == "nixl" and label == " paired round 2":  # a run that fails: no result
            return []
        times = {"pddnet_nocma": 1.2e-3, "pddnet": 1e-3, "raw_ucxx": 0.9e-3, "nixl": 1.5e-3}
        return [{"median_s": times[name]}]

    out = local._paired_rounds(run, _args("--quick", "--rounds", "3"), 16 << 20)
    names = ["pddnet_nocma", "pddnet", "raw_ucxx", "nixl"]
    assert calls == [
        *((n, " paired round 1") for n in names),
        *((n, " paired round 2") for n in names[1:] + names[:1]),
        *((n, " paired round 3") for n in names[2:] + names[:2]),
    ]
    assert out["pddnet_nocma"] == pytest.approx([1200.0] * 3)
    assert out["pddnet"] == pytest.approx([1000.0] * 3)
    assert out["nixl"] == [pytest.approx(1500.0), None, pytest.approx(1500.0)]


def test_the_headline_ratios_use_the_deployed_receiver() -> None:
    """RLD's receiver has no cma: ``ratio_vs_nixl_16mib`` is its ratio, ``_cma`` the other."""
    paired: dict[str, list[float | None]] = {
        "pddnet_nocma": [2000.0, 2200.0, 1800.0],
        "pddnet": [1000.0, 1100.0, 900.0],
        "raw_ucxx": [800.0, 880.0, 720.0],
        "nixl": [1500.0, 1650.0, 1350.0],
    }
    out = local.paired_ratios(paired)
    assert out["ratio_vs_nixl_16mib"] == pytest.approx(0.75)
    assert out["ratio_vs_nixl_16mib_cma"] == pytest.approx(1.5)
    assert out["ratio_vs_raw_ucxx_16mib"] == pytest.approx(0.4)
    assert out["ratio_vs_raw_ucxx_16mib_cma"] == pytest.approx(0.8)
    assert out["nocma_ratio_16mib"] == pytest.approx(0.5)
    assert out["ratio_vs_nixl_16mib_rounds"] == pytest.approx([0.75] * 3)
    assert set(out["failed_rounds"].values()) == {0}


def test_failed_paired_rounds_are_counted_not_dropped() -> None:
    paired: dict[str, list[float | None]] = {
        "pddnet_nocma": [1000.0, None, 1000.0, 1000.0],
        "pddnet": [1000.0, 1000.0, 1000.0, 1000.0],
        "nixl": [1500.0, 1500.0, None, 1200.0],
    }
    out = local.paired_ratios(paired)
    assert out["ratio_vs_nixl_16mib_rounds"] == [1.5, None, None, 1.2]
    assert out["ratio_vs_nixl_16mib"] == pytest.approx(1.35)  # the median of the rounds that ran
    assert out["failed_rounds"]["ratio_vs_nixl_16mib"] == 2
    assert out["failed_rounds"]["ratio_vs_nixl_16mib_cma"] == 1
    assert out["failed_rounds"]["nocma_ratio_16mib"] == 1
    # raw ucxx did not run at all: no rounds, no ratio, nothing failed
    assert out["ratio_vs_raw_ucxx_16mib"] is None and out["ratio_vs_raw_ucxx_16mib_rounds"] == []
    assert out["failed_rounds"]["ratio_vs_raw_ucxx_16mib"] == 0
    every_round_failed = local.paired_ratios({"pddnet_nocma": [None, None], "nixl": [1.0, 1.0]})
    assert every_round_failed["ratio_vs_nixl_16mib"] is None
    assert every_round_failed["failed_rounds"]["ratio_vs_nixl_16mib"] == 2


def test_paired_rounds_need_pddnet_and_a_peer() -> None:
    def run(*_: Any) -> list[dict[str, Any]]:
        raise AssertionError("nothing should run")

    assert local._paired_rounds(run, _args("--only", "pddnet", "tcp"), 1) == {}
    assert local._paired_rounds(run, _args("--only", "raw_ucxx", "nixl"), 1) == {}
    assert local._paired_rounds(run, _args("--rounds", "0"), 1) == {}


def test_a_peer_venv_that_cannot_be_made_is_reported(tmp_path: Path) -> None:
    """``--install-peers`` where the venv cannot be made: every step's error, no exception."""
    (tmp_path / "file").write_text("")
    venv = str(tmp_path / "file" / "venv")  # under a regular file: venv and pip fail
    errors: dict[str, str] = {}
    local._install_peers(venv, errors)
    assert set(errors) == {venv, "numpy", "mooncake-transfer-engine-non-cuda"}
    assert all(errors.values())


@pytest.mark.ucx
@pytest.mark.skipif(not available("ucxx"), reason="ucxx is not installed")
def test_quick_run_against_raw_ucxx(tmp_path: Path) -> None:
    """The deployed receiver against raw ucxx; NIXL's missing venv fails every round."""
    out = tmp_path / "local.json"
    only = ("--only", "pddnet_nocma", "raw_ucxx", "nixl", "--peer-venv", str(tmp_path / "none"))
    args = _args("--quick", *only, "--rounds", "2", "--json", str(out))
    assert local.main(args) == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert set(report["errors"]) - {"raw_ucxx/xhost"} == {
        "nixl/sm",
        "nixl/tcp",
        "nixl/xhost",
        "nixl/sm paired round 1",
        "nixl/sm paired round 2",
    }
    rows = {(r["impl"], r["mode"], r["size"]) for r in report["rows"]}
    # raw ucxx cross-host too, where network namespaces can be made (else its error)
    xhost = [] if "raw_ucxx/xhost" in report["errors"] else [("raw_ucxx", "xhost")]
    assert rows == {
        (impl, mode, size)
        for impl, mode in [("pddnet_nocma", "sm"), ("raw_ucxx", "sm"), ("raw_ucxx", "tcp"), *xhost]
        for size in local.K_QUICK_SIZES
    }
    paired = summary["paired_16mib_us"]
    assert set(paired) == {"pddnet_nocma", "raw_ucxx", "nixl"}
    assert paired["nixl"] == [None, None]
    assert all(
        len(paired[k]) == 2 and all(x > 0 for x in paired[k]) for k in ("pddnet_nocma", "raw_ucxx")
    )
    rounds = summary["ratio_vs_raw_ucxx_16mib_rounds"]
    assert rounds == pytest.approx(
        [r / p for p, r in zip(paired["pddnet_nocma"], paired["raw_ucxx"], strict=True)]
    )
    assert summary["ratio_vs_raw_ucxx_16mib"] == pytest.approx(
        sorted(rounds)[0] / 2 + sorted(rounds)[1] / 2
    )
    assert summary["ratio_vs_nixl_16mib"] is None and summary["ratio_vs_nixl_16mib_rounds"] == [
        None,
        None,
    ]
    assert summary["failed_rounds"]["ratio_vs_nixl_16mib"] == 2
    assert summary["failed_rounds"]["ratio_vs_raw_ucxx_16mib"] == 0
    assert summary["ratio_vs_raw_ucxx_16mib_cma"] is None  # pddnet with cma did not run
    assert "no peer environment" in summary["nixl_error"]


def test_layerwise_summary_is_the_paired_ratio_per_mode() -> None:
    """``layerwise_overhead_L``: cross-host; ``_sm``: same host; None where a mode did not run."""
    res = {
        "xhost": [
            {
                "size": 32,
                "median_s": 0.012,
                "whole_median_s": 0.010,
                "overhead": 1.15,
                "n": 10,
                "bytes": 16 << 20,
            },
            {
                "size": 80,
                "median_s": 0.030,
                "whole_median_s": 0.025,
                "overhead": 1.21,
                "n": 10,
                "bytes": 40 << 20,
            },
        ],
        "sm": [],
    }
    out = local.layerwise_summary(res)
    assert out["layerwise_overhead_32"] == 1.15 and out["layerwise_overhead_80"] == 1.21
    assert out["layerwise_overhead_32_sm"] is None and out["layerwise_overhead_80_sm"] is None
    assert out["layerwise_us"]["xhost"]["32"] == {
        "layerwise_us": pytest.approx(12000.0),
        "whole_us": pytest.approx(10000.0),
        "mib": 16.0,
        "pairs": 10,
    }


@pytest.mark.ucx
@pytest.mark.skipif(not available("ucxx"), reason="ucxx is not installed")
def test_layerwise_run_writes_its_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real processes: a 2- and a 3-layer request, whole and layer by layer, per mode."""
    monkeypatch.setattr(local, "K_LAYERS", (2, 3))
    monkeypatch.setattr(local, "K_LAYERWISE_ITERS", {True: 6, False: 6})
    monkeypatch.setenv("PDDNET_BENCH_LW_BLOCKS", "2")
    out = tmp_path / "local.json"
    args = _args("--quick", "--only", "layerwise", "--peer-venv", str(tmp_path / "none"))
    args.json = str(out)
    assert local.main(args) == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert set(report["errors"]) <= {"layerwise/xhost"}  # no namespaces: that mode's reason
    modes = ["sm"] + ([] if report["errors"] else ["xhost"])
    for mode in modes:
        suffix = "" if mode == "xhost" else "_sm"
        for layers in (2, 3):
            assert summary[f"layerwise_overhead_{layers}{suffix}"] > 0
            row = summary["layerwise_us"][mode][str(layers)]
            assert row["pairs"] == 2 and row["layerwise_us"] > 0 and row["whole_us"] > 0
            # 2 blocks x 2 planes x 32 KiB per layer
            assert row["mib"] == pytest.approx(layers * 2 * 2 * 32 * 1024 / (1 << 20))
    assert report["rows"] == []  # layerwise is not a table row
