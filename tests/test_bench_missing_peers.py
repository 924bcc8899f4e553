"""Each benchmark names the peer it lacks, and how to get it, below its table
and in its summary's ``missing_peers`` (as ``bench wan`` does for iperf3)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pddnet.bench import faults, local
from pddnet.bench._common import K_EMU_HOW
from pddnet.emu import unavailable_reason


def _bench(
    *argv: str, path: str | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = Path(argv[argv.index("--json") + 1])
    env = {**os.environ, **({"PATH": path} if path is not None else {})}
    proc = subprocess.run(
        [sys.executable, "-m", "pddnet", "bench", *argv],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def _path_without(tmp: Path, *tools: str) -> str:
    """A PATH of one folder holding every program on PATH but ``tools``."""
    folder = tmp / "bin"
    folder.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            src = os.path.join(d, name)
            dst = folder / name
            if name not in tools and not dst.exists() and os.access(src, os.X_OK):
                dst.symlink_to(src)
    return str(folder)


# ------------------------------------------------------------- bench local
def test_bench_local_names_the_missing_nixl_and_mooncake(tmp_path: Path) -> None:
    venv = tmp_path / "none"
    proc, rep = _bench(
        "local",
        "--quick",
        "--only",
        "nixl",
        "mooncake",
        "--peer-venv",
        str(venv),
        "--rounds",
        "0",
        "--json",
        str(tmp_path / "l.json"),
    )
    missing = rep["summary"]["missing_peers"]
    assert set(missing) == {"nixl", "mooncake"}
    for peer, why in missing.items():
        assert f"no peer environment at {venv}" in why and "--install-peers" in why
        assert f"missing peer {peer}: {why}" in proc.stdout.splitlines()
    assert rep["rows"] == [] and rep["errors"]["nixl/sm"] == missing["nixl"]


def test_a_peer_venv_without_the_peer_is_missing_it(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)  # no nixl_cu12, no mooncake
    missing = local.missing_peers(str(venv), ["nixl", "mooncake", "tcp"])
    assert set(missing) == {"nixl", "mooncake"}
    assert "import nixl_cu12._api failed" in missing["nixl"]
    assert "ModuleNotFoundError" in missing["nixl"] and "--install-peers" in missing["nixl"]
    assert local.missing_peers(str(venv), ["tcp"]) == {}  # tcp needs no peer


# ------------------------------------------------------------- bench handoff
def test_bench_handoff_names_the_missing_emulated_wan(tmp_path: Path) -> None:
    proc, rep = _bench(
        "handoff",
        "--quick",
        "--model",
        "tiny",
        "--tokens",
        "4",
        "--repeat",
        "2",
        "--warmup",
        "0",
        "--device",
        "numpy",
        "--json",
        str(tmp_path / "h.json"),
        path=_path_without(tmp_path, "ip"),
    )
    summary = rep["summary"]
    why = summary["missing_peers"]["emulated WAN"]
    assert summary["network"] == "loopback" and why.startswith(summary["fallback"])
    assert K_EMU_HOW in why
    assert set(summary["missing_peers"]) == {"emulated WAN"}  # --device numpy: asked for
    table_end = proc.stdout.index("missing peer emulated WAN:")
    assert "handoff latency" in proc.stdout[:table_end]


# ------------------------------------------------------------- bench faults
def test_faults_missing_peers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    why = faults.missing_peers("needs root (network namespaces)", faults.FAULTS)
    assert list(why) == ["emulated WAN"] and K_EMU_HOW in why["emulated WAN"]
    assert why["emulated WAN"].startswith("needs root (network namespaces): ")
    monkeypatch.setenv("PATH", str(tmp_path))  # no ss
    assert "apt-get install iproute2" in faults.missing_peers(None, ["stream_reset"])["ss"]
    assert faults.missing_peers(None, ["none", "kill_md"]) == {}  # they need no ss


@pytest.mark.netns
@pytest.mark.skipif(unavailable_reason() is not None, reason="needs the emulated WAN")
@pytest.mark.skipif(shutil.which("ss") is None, reason="ss is missing here anyway")
def test_bench_faults_without_ss_runs_the_rest_and_names_it(tmp_path: Path) -> None:
    proc, rep = _bench(
        "faults",
        "--quick",
        "--faults",
        "none,stream_reset",
        "--json",
        str(tmp_path / "f.json"),
        path=_path_without(tmp_path, "ss"),
    )
    summary = rep["summary"]
    assert summary["faults_seen"] == ["none"]  # stream_reset would not reset anything
    assert "apt-get install iproute2" in summary["missing_peers"]["ss"]
    assert f"missing peer ss: {summary['missing_peers']['ss']}" in proc.stdout
