"""The local-path probe and the demo's choice of UCX (issue 20, item 3).

Real processes in the testbed's network namespaces (``dc-a-p`` sends,
``dc-a-rld`` receives, as in the demo): UCX works there, over tcp, and when it
cannot (``UCX_TLS=sm,self``: shared memory never crosses namespaces) the
probe and the demo say why in UCX's own words, and the demo takes TCP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pddnet._optional import available
from pddnet.emu import unavailable_reason
from pddnet.transport.local import probe_local_path
from pddnet.transport.local._ep_info import endpoint_transports

UCX = available("ucxx._lib.libucxx")
ucx = pytest.mark.skipif(not UCX, reason="ucxx is not installed")
ENV = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_TLS": "tcp,sm,self"}
# UCX's words when no transport reaches the peer (the sender's endpoint fails)
K_NO_TRANSPORT = "no active messages transport"


@pytest.mark.ucx
@ucx
def test_probe_between_network_namespaces(wan_link) -> None:  # type: ignore[no-untyped-def]
    """1 MiB from dc-a-p to dc-a-rld arrives; UCX chose tcp (the sender left out sm)."""
    wan = wan_link(rtt="1ms")
    probe = probe_local_path(wan.rld.spawn, wan.p.spawn, env=ENV)
    assert probe.path == "ucx", probe.reason
    assert probe.reason is None and probe.seconds is not None and probe.seconds > 0
    assert probe.transports and all(t.startswith("tcp/") for t in probe.transports), probe
    assert "sm" not in probe.tls.split(","), probe.tls


@pytest.mark.ucx
@ucx
def test_probe_fails_with_ucx_reason(wan_link) -> None:  # type: ignore[no-untyped-def]
    """Shared memory only, across namespaces: no UCX, and the reason is UCX's error."""
    wan = wan_link(rtt="1ms")
    probe = probe_local_path(wan.rld.spawn, wan.p.spawn, env={**ENV, "UCX_TLS": "sm,self"})
    assert probe.path == "tcp" and probe.transports == ()
    assert probe.reason is not None and K_NO_TRANSPORT in probe.reason, probe.reason
    assert "PeerUnavailable" in probe.reason, probe.reason


def test_probe_without_a_receiver_says_so() -> None:
    """A receiver process that dies at once: the reason is its last stderr line."""

    def broken(argv: list[str], **kw: object) -> subprocess.Popen[str]:
        cmd = "import sys; print('ValueError: no receiver here', file=sys.stderr)"
        return subprocess.Popen([sys.executable, "-c", cmd], **kw)  # type: ignore[call-overload]

    probe = probe_local_path(broken, subprocess.Popen, timeout=20)
    assert probe == type(probe)("tcp", reason="ValueError: no receiver here")


def test_endpoint_transports_without_an_endpoint() -> None:
    assert endpoint_transports(None) == ()


def _demo(tmp_path: Path, env: dict[str, str]) -> tuple[str, dict[str, object]]:
    out = tmp_path / "demo.json"
    argv = [sys.executable, "-m", "pddnet", "demo", "--quick", "--sessions", "1"]
    argv += ["--turns", "1", "--max-tokens", "16", "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, env=env, timeout=300, cwd=tmp_path)
    stdout = proc.stdout.decode()
    assert proc.returncode == 0, stdout[-3000:] + proc.stderr.decode()[-3000:]
    return stdout, json.loads(out.read_text())["summary"]


@pytest.mark.ucx
@ucx
@pytest.mark.skipif(unavailable_reason() is not None, reason="needs network namespaces")
def test_demo_falls_back_to_tcp_with_the_reason(tmp_path: Path) -> None:
    """UCX cannot connect (shared memory only): the demo prints UCX's error and runs on TCP."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**ENV, "UCX_TLS": "sm,self", "PYTHONPATH": root}
    stdout, summary = _demo(tmp_path, env)
    line = next(ln for ln in stdout.splitlines() if ln.startswith("P->RLD local path:"))
    assert line.startswith("P->RLD local path: TCP, because UCX failed"), line
    assert summary["local_path"] == "tcp", summary
    reason = str(summary["local_path_reason"])
    assert reason in line
    assert "dc-a-p -> dc-a-rld" in line and K_NO_TRANSPORT in reason, reason
    assert summary["tokens_match_reference"] is True
