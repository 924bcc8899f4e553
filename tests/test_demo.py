"""A small ``pddnet demo`` in CI: real processes, real sockets, the emulated WAN as root."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pddnet.emu import unavailable_reason


def test_small_demo_matches_greedy_and_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pddnet",
            "demo",
            "--quick",
            "--sessions",
            "2",
            "--turns",
            "2",
            "--max-tokens",
            "24",
            "--json",
            str(out),
            "--png",
            str(tmp_path / "t.png"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["tokens_match_reference"] is True
    assert summary["lost_requests"] == 0 and summary["failed_requests"] == 0
    assert summary["requests"] == 8
    assert (tmp_path / "t.png").stat().st_size > 10_000
    if unavailable_reason() is None:
        # on the shaped WAN, RLD really masks the low-hit requests' transfers
        assert summary["link"].startswith("emulated WAN")
        assert summary["rld_token_share"] > 0
        assert summary["ttft_p50_ms_low_hit_pdd"] < summary["ttft_p50_ms_low_hit_baseline"]
