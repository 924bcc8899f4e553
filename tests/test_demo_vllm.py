"""``pddnet demo --engine vllm``: P, RLD and MD as three vLLM CPU instances.

The end-to-end run (slow, skipped without vLLM) runs the quick demo as the
user does and checks its summary against issue 18's targets: every request of
both phases finished with single-instance vLLM's greedy tokens (the oracle
runs in a process of its own, without pddnet), none lost or failed, at least
one handoff took 2+ rounds (a catch-up), the low-hit p50 TTFT fell by at
least 0.4, and, unless the machine is overloaded, in under 3 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pddnet import LocalProtocolError, demo
from pddnet.demo._zygote import K_ROLES_MODULE, Zygote
from pddnet.integrations.vllm import build_tiny_llama


def _config(*argv: str) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return demo.run_config(parser.parse_args(list(argv)))


def test_engine_option_and_its_defaults() -> None:
    ref, vllm = _config(), _config("--engine", "vllm")
    assert (ref["engine"], ref["max_tokens"], ref["catchup_threshold"]) == ("reference", 32, 64)
    assert (vllm["engine"], vllm["max_tokens"], vllm["catchup_threshold"]) == ("vllm", 128, 16)
    assert vllm["first_turn_tokens"] == demo.K_VLLM_FIRST_TURN_TOKENS == 512
    assert (ref["rate_bps"], vllm["rate_bps"]) == (25e6, 25e6)
    given = _config("--engine", "vllm", "--max-tokens", "20", "--catchup-threshold", "64")
    assert (given["max_tokens"], given["first_turn_tokens"], given["catchup_threshold"]) == (
        20,
        20,
        64,
    )


def check_targets(summary: dict[str, Any]) -> list[str]:
    """Issue 18's targets for ``demo --engine vllm --quick``: the ones missed."""
    s = summary
    missed = []
    if s["tokens_match_reference"] is not True:
        missed.append("tokens_match_reference")
    if s["lost_requests"] != 0 or s["failed_requests"] != 0:
        missed.append("lost/failed requests")
    if not s["handoff_rounds_max"] >= 2:
        missed.append(f"handoff_rounds_max {s['handoff_rounds_max']} < 2")
    if not s["ttft_p50_reduction_low_hit"] >= 0.4:
        missed.append(f"ttft_p50_reduction_low_hit {s['ttft_p50_reduction_low_hit']} < 0.4")
    if not s["elapsed_s"] < 180:
        missed.append(f"elapsed_s {s['elapsed_s']} >= 180")
    return missed


def test_check_targets_catches_each_miss() -> None:
    ok = {
        "tokens_match_reference": True,
        "lost_requests": 0,
        "failed_requests": 0,
        "handoff_rounds_max": 2,
        "ttft_p50_reduction_low_hit": 0.5,
        "elapsed_s": 90.0,
    }
    assert check_targets(ok) == []
    misses = {  # one run of the previous defaults ended with rounds 1 (docs/benchmarks.md)
        "handoff_rounds_max": 1,
        "ttft_p50_reduction_low_hit": 0.39,
        "tokens_match_reference": False,
        "failed_requests": 1,
        "elapsed_s": 181.0,
        "rld_token_share": 0.0,  # not a target: not checked
    }
    for key, value in misses.items():
        assert len(check_targets({**ok, key: value})) == (key != "rld_token_share"), key


@pytest.mark.slow  # seven vLLM processes forked from one zygote: 33-47 s at load 1-4
def test_vllm_demo_streams_vllm_greedy_tokens(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'pddnet[vllm]')")
    out = tmp_path / "demo.json"
    busy = os.getloadavg()[0] > (os.cpu_count() or 1)  # others' jobs on this machine
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
    missed = check_targets(s)
    # The 3-minute bound is for a machine the demo has to itself: at a load
    # average of 8-10 on 2 cores the seven vLLM start-ups alone took longer
    # before the zygote (docs/benchmarks.md: 41 CPU s for the whole demo now,
    # 91 then); every other target holds at any load. The load is read
    # before the demo starts, so the demo's own does not count.
    if busy:
        missed = [m for m in missed if not m.startswith("elapsed_s")]
    assert missed == [], s
    assert s["rld_token_share"] > 0  # the routed phase's low-hit requests went through RLD
    # every stream complete: 512 tokens for each session's first turn, else 128
    for r in report["records"]:
        assert len(r["tokens"]) == (512 if r["turn"] == 0 else 128), (r["session"], r["turn"])


def _role_argv(role: str, cfg: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", K_ROLES_MODULE, role, json.dumps(cfg)]


def test_zygote_children_report_their_end_and_output(tmp_path: Path) -> None:
    with Zygote(preload=()) as z:  # nothing preloaded: P imports vLLM for seconds
        with pytest.raises(LocalProtocolError, match=r"runs pddnet\.demo\._vllm_roles only"):
            z.fork([sys.executable, "-c", "pass"])
        bad = z.fork([*_role_argv("oracle", {})[:4], "not json"])
        out, _ = bad.communicate(timeout=60)
        assert bad.returncode == 1
        assert "JSONDecodeError" in out  # the child's stderr comes back on its pipe
        slow = z.spawner()(_role_argv("prefill", {}), env={"X": "1"})
        assert slow.returncode is None
        slow.kill()
        assert slow.wait(timeout=30) == -9
        assert slow.returncode == -9
        running = z.fork(_role_argv("prefill", {}))
    # closing the zygote ends what it forked
    assert running.wait(timeout=30) == -9


@pytest.mark.slow  # three vLLM start-ups: about a minute on 2 loaded cores
def test_forked_oracle_streams_equal_a_fresh_process(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'pddnet[vllm]')")
    model = str(build_tiny_llama(tmp_path / "model"))
    records = [
        {"request_id": 1, "prompt": [(7 * i) % 500 + 3 for i in range(70)], "max_tokens": 24},
        {"request_id": 2, "prompt": [11, 12, 13], "max_tokens": 8},
    ]
    with Zygote({**os.environ, "OMP_NUM_THREADS": demo.K_VLLM_THREADS}) as z:
        forked = demo.vllm_reference_streams(
            records, model, tmp_path, z.spawner()
        )  # waits for the imports
        t = time.monotonic()
        again = demo.vllm_reference_streams(records, model, tmp_path, z.spawner())
        forked_s = time.monotonic() - t
    t = time.monotonic()
    fresh = demo.vllm_reference_streams(records, model, tmp_path)
    fresh_s = time.monotonic() - t
    assert forked == again == fresh
    assert [len(v) for v in fresh.values()] == [24, 8]
    # what the zygote saves each vLLM process: importing vLLM (10 of ~13 CPU s)
    assert forked_s < 0.5 * fresh_s, (forked_s, fresh_s)
