"""``pddnet demo --engine vllm``: P, RLD and MD as three vLLM CPU instances.

The end-to-end run (slow, skipped without vLLM) runs the quick demo as the
user does and checks its summary: every request of both phases finished with
single-instance vLLM's greedy tokens (the oracle runs in a process of its own,
without pddnet), none lost or failed, and the routed phase used RLD.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pddnet import demo


def _config(*argv: str) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return demo._config(parser.parse_args(list(argv)))


def test_engine_option_and_its_defaults() -> None:
    ref, vllm = _config(), _config("--engine", "vllm")
    assert (ref["engine"], ref["max_tokens"], ref["catchup_threshold"]) == ("reference", 32, 64)
    assert (vllm["engine"], vllm["max_tokens"], vllm["catchup_threshold"]) == ("vllm", 128, 16)
    assert (ref["rate_bps"], vllm["rate_bps"]) == (25e6, 50e6)
    given = _config("--engine", "vllm", "--max-tokens", "20", "--catchup-threshold", "64")
    assert (given["max_tokens"], given["catchup_threshold"]) == (20, 64)


@pytest.mark.slow  # seven vLLM engine start-ups on 2 cores: ~1.5-3 minutes
def test_vllm_demo_streams_vllm_greedy_tokens(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'pddnet[vllm]')")
    out = tmp_path / "demo.json"
    argv = [sys.executable, "-m", "pddnet", "demo", "--engine", "vllm", "--quick"]
    proc = subprocess.run(
        [*argv, "--json", str(out), "--png", ""],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    s = report["summary"]
    assert s["requests"] == 2 * 4 * 4  # --quick: 4 sessions x 4 turns, two phases
    assert s["tokens_match_reference"] is True
    assert s["lost_requests"] == 0 and s["failed_requests"] == 0
    assert s["rld_token_share"] > 0  # the routed phase's low-hit requests went through RLD
    for key in ("handoff_rounds_max", "ttft_p50_reduction_low_hit"):
        assert key in s
    tokens = {len(r["tokens"]) for r in report["records"]}
    assert tokens == {128}, tokens  # every stream complete at vLLM's default length
