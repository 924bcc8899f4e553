"""``pddnet bench handoff`` end to end: real MD and RLD processes, tiny runs.

The loopback run works anywhere; the emulated one needs root, network
namespaces and /dev/net/tun and skips otherwise. Only sizes and sanity are
asserted: speed targets belong to the benchmark's own report.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from pddnet.bench import handoff
from pddnet.bench._handoff_peer import tune_wan_sockets
from pddnet.control import TcpTuning
from pddnet.control._tcp import K_TCP_RTO_MIN_US
from pddnet.emu import unavailable_reason

K_KEYS = {
    "token_payload_bytes_100",
    "kv_payload_bytes_100",
    "recompute_cv",
    "kv_ship_cv",
    "kv_ship_max_over_mean",
}


def _run(tmp_path: Path, *argv: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    handoff.add_arguments(parser)
    out = tmp_path / "h.json"
    png = tmp_path / "h.png"
    args = parser.parse_args([*argv, "--json", str(out), "--png", str(png)])
    assert handoff.main(args) == 0
    assert png.stat().st_size > 1000
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def _check_sane(report: dict[str, Any], b: int, repeat: int) -> dict[str, Any]:
    s = report["summary"]
    assert set(s) >= K_KEYS
    assert s["kv_payload_bytes_100"] == 100 * b  # exact: the incremental KV, not whole blocks
    assert s["kv_wire_bytes_mean"] >= 100 * b
    # an authenticated TokenBatch: ~45 fixed bytes plus 1-3 varint bytes per id, once per
    # control path (RLD sends every control frame on each of its paths to MD)
    assert 100 + 40 < s["token_frame_bytes"] <= 45 + 3 * 100
    assert s["token_payload_bytes_100"] == s["control_paths"] * s["token_frame_bytes"]
    assert s["control_paths"] == 2 and s["control"]["copies_sent"] > 0
    assert s["repeat"] == repeat
    for key in ("kv_ship_mean_ms", "recompute_mean_ms", "md_compute_mean_ms"):
        assert 0 < s[key] < 60_000
    assert s["kv_ship_max_over_mean"] >= 1 and s["recompute_cv"] >= 0
    pt = report["results"][0]["points"][0]
    assert len(pt["kv_s"]) == len(pt["token_s"]) == repeat
    assert all(t > 0 for t in pt["kv_s"] + pt["token_s"])
    # MD's recompute happens inside the token-ID round trip, so it is never longer
    md = {m["rid"]: m["compute_s"] for m in report["results"][0]["md"] if "compute_s" in m}
    for rid, t in zip(pt["request_ids"], pt["token_s"], strict=True):
        assert 0 < md[rid] < t
    return s


def _rto_read_back(us: int | None) -> int:
    """What the kernel reads back as TCP_RTO_MIN_US after setting ``us`` (None: untouched)."""
    with socket.socket() as s:
        if us is not None:
            s.setsockopt(socket.IPPROTO_TCP, K_TCP_RTO_MIN_US, us)
        return int(s.getsockopt(socket.IPPROTO_TCP, K_TCP_RTO_MIN_US))


def _kernel_has_rto_min() -> bool:
    try:
        _rto_read_back(5000)
    except OSError:
        return False
    return True


needs_rto_min = pytest.mark.skipif(
    not _kernel_has_rto_min(), reason="kernel lacks TCP_RTO_MIN_US (Linux < 6.15)"
)


@needs_rto_min
@pytest.mark.parametrize("tcp", ["wan", "default"])
def test_loopback_run_reports_sane_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tcp: str
) -> None:
    shape = "layers=4,kv_heads=2,head_dim=64,dtype=float32"  # the model's own KV: shared pool
    report = _run(
        tmp_path,
        *("--loopback", "--repeat", "3", "--warmup", "1", "--prefix", "32", "--tcp", tcp),
        *("--model", shape, "--streams", "3"),
    )
    s = _check_sane(report, 4 * 2 * 2 * 64 * 4, 3)
    assert s["network"] == "loopback" and s["fallback"]
    assert "LOOPBACK" in capsys.readouterr().err  # said plainly, not silently
    # MD recomputed the model whose KV was shipped, at its real width (8 x 64)
    assert s["same_model"] and report["model"]["model"]["hidden"] == 512
    assert "width 512" in s["model"]
    assert 0 < s["gpu_cost_model"]["recompute_ms"] < s["md_compute_mean_ms"]
    # one TCP setting for both methods: the control connections and every KV stream, at
    # both ends, are tuned exactly when --tcp wan says so (read back from the kernel)
    t = s["tcp"]
    want = _rto_read_back(5000 if tcp == "wan" else None)
    assert t["setting"] == tcp
    assert (t["control_connections_tuned"] > 0) == (tcp == "wan")
    assert len(t["wan_rto_min_us_rld"]) >= 3 and len(t["wan_rto_min_us_md"]) >= 3
    assert set(t["wan_rto_min_us_rld"]) == set(t["wan_rto_min_us_md"]) == {want}


@needs_rto_min
def test_tune_wan_sockets_tunes_the_connections_of_the_port_only() -> None:
    tuning = TcpTuning.wan()
    with socket.socket() as lst, socket.socket() as cli, socket.socket() as other:
        lst.bind(("127.0.0.1", 0))
        lst.listen()
        port = lst.getsockname()[1]
        cli.connect(("127.0.0.1", port))
        srv, _ = lst.accept()
        with srv:
            default = _rto_read_back(None)
            # the accepted end (MD: the port is local); the listener is left alone
            assert tune_wan_sockets(port, True, tuning) == [_rto_read_back(5000)]
            assert srv.getsockopt(socket.IPPROTO_TCP, K_TCP_RTO_MIN_US) == _rto_read_back(5000)
            assert lst.getsockopt(socket.IPPROTO_TCP, K_TCP_RTO_MIN_US) == default
            assert cli.getsockopt(socket.IPPROTO_TCP, K_TCP_RTO_MIN_US) == default
            # the connecting end (RLD: the port is the peer's)
            assert tune_wan_sockets(port, False, tuning) == [_rto_read_back(5000)]
            assert cli.getsockopt(socket.IPPROTO_TCP, K_TCP_RTO_MIN_US) == _rto_read_back(5000)
            assert other.getsockopt(socket.IPPROTO_TCP, K_TCP_RTO_MIN_US) == default
            # untuned: only read back
            assert tune_wan_sockets(port + 1, False, None) == []
            # descriptors that are not sockets are not leaked (a dup per call ran out of fds)
            with open(__file__) as f:
                before = len(os.listdir("/proc/self/fd"))
                for _ in range(5):
                    tune_wan_sockets(port, True, tuning)
                assert len(os.listdir("/proc/self/fd")) == before and not f.closed


@pytest.mark.netns
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"{unavailable_reason()}")
def test_emulated_run_reports_sane_values(tmp_path: Path) -> None:
    report = _run(
        tmp_path,
        "--wan",
        "rtt=10ms,jitter=1ms,loss=0,rate=1gbit",
        "--repeat",
        "3",
        "--warmup",
        "1",
        "--prefix",
        "32",
        "--model",
        "layers=4,kv_heads=2,head_dim=64,dtype=float16",
    )
    s = _check_sane(report, 4 * 2 * 2 * 64 * 2, 3)
    assert s["network"] == "emulated" and s["fallback"] is None
    # every handoff crosses the 10 ms RTT link at least once
    assert s["kv_ship_p50_ms"] > 5 and s["recompute_p50_ms"] > 5
