"""Measurements on a running testbed: idle RTT, UDP loss, TCP throughput, self-checks.

RTT and loss probes run in-process: the sockets are created inside the hosts'
namespaces (:meth:`Host.inside`) and keep living there. Throughput uses iperf3
when installed (``iperf3 -P N``), otherwise a built-in multi-stream TCP
sender/receiver pair (threads, one socket per stream).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import statistics
import struct
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

from .._errors import TransportError
from ._testbed import Host, Testbed

__all__ = [
    "Throughput",
    "check",
    "measure_loss",
    "measure_rtt",
    "measure_throughput",
    "rtt_tolerance",
]

K_CPU_LIMIT = 0.90  # forwarder CPU (fraction of one core) above which a run is invalid
K_LATE_FRACTION = 0.01  # more than 1% of packets released > 1 ms late: invalid
_PORT = 5201


def rtt_tolerance(rtt: float) -> float:
    """Allowed idle-RTT error: 10% of the configured RTT plus 1 ms."""
    return 0.1 * rtt + 1e-3


def _udp(host: Host, bind: bool, rcvbuf: int = 0) -> socket.socket:
    with host.inside():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, 33, rcvbuf)  # SO_RCVBUFFORCE (root)
    if bind:
        s.bind((host.addr, 0))
    return s


def measure_rtt(
    src: Host, dst: Host, *, count: int = 20, interval: float = 0.01, size: int = 64
) -> list[float]:
    """Idle round-trip times (seconds) of UDP echoes from ``src`` to ``dst``.

    An echo thread answers on ``dst``; probes are sent one at a time, so the link
    stays idle. Lost probes are skipped (a 1 s timeout each).

    Returns:
        The measured RTTs, in order.
    """
    srv = _udp(dst, True)
    cli = _udp(src, False)
    cli.settimeout(1.0)
    srv.settimeout(0.2)
    stop = threading.Event()

    def echo() -> None:
        while not stop.is_set():
            try:
                data, addr = srv.recvfrom(65536)
            except TimeoutError:
                continue
            srv.sendto(data, addr)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    out: list[float] = []
    try:
        target = srv.getsockname()
        for i in range(count):
            payload = struct.pack("!I", i).ljust(size, b"\0")
            t0 = time.perf_counter()
            cli.sendto(payload, target)
            while True:
                try:
                    data = cli.recv(65536)
                except TimeoutError:
                    break
                if data[:4] == payload[:4]:
                    out.append(time.perf_counter() - t0)
                    break
            time.sleep(interval)
    finally:
        stop.set()
        t.join()
        srv.close()
        cli.close()
    return out


def measure_loss(
    src: Host,
    dst: Host,
    *,
    packets: int = 4000,
    size: int = 1000,
    pps: float = 20000.0,
    settle: float = 0.5,
) -> tuple[int, int]:
    """Send numbered UDP datagrams from ``src`` to ``dst`` and count arrivals.

    Pace ``pps`` so the bottleneck queue never overflows, or queue drops count too.

    Returns:
        ``(sent, received)``.
    """
    rx = _udp(dst, True, rcvbuf=max(packets * (size + 512), 1 << 20))
    tx = _udp(src, False)
    target = rx.getsockname()
    seen = bytearray(packets)
    t0 = time.perf_counter()
    for i in range(packets):
        tx.sendto(struct.pack("!I", i).ljust(size, b"\0"), target)
        lag = t0 + (i + 1) / pps - time.perf_counter()
        if lag > 0:
            time.sleep(lag)
    rx.settimeout(settle)
    received = 0
    try:
        while True:
            data = rx.recv(65536)
            (i,) = struct.unpack_from("!I", data)
            if i < packets and not seen[i]:
                seen[i] = 1
                received += 1
    except TimeoutError:
        pass
    finally:
        rx.close()
        tx.close()
    return packets, received


@dataclass(frozen=True)
class Throughput:
    """Result of :func:`measure_throughput`.

    Attributes:
        bits_per_second: goodput over the measured window, from the receiving
            kernel's ``bytes_received`` counters (``ss -ti``) sampled at both ends
            of the window: it does not depend on when the application read.
        tool: ``"iperf3"`` or ``"builtin"``.
        streams: parallel TCP connections.
        seconds: measured window (after the omitted ramp-up).
        retransmits: sender retransmissions (iperf3 only, else -1).
        tool_bits_per_second: the tool's own receiver figure (iperf3's server
            ``sum_received``; ``None`` for builtin). Its window edges follow the
            application's reads, which lag on a loaded box: 1-3% high was seen.
    """

    bits_per_second: float
    tool: str
    streams: int
    seconds: float
    retransmits: int = -1
    tool_bits_per_second: float | None = None


def _rx_bytes(host: Host, port: int) -> tuple[float, int]:
    """(time, total bytes_received) of the TCP connections to ``port`` on ``host``."""
    t0 = time.monotonic()
    out = host.run(["ss", "-Htin", "state", "established", "sport", "=", f":{port}"]).stdout
    t1 = time.monotonic()
    total = sum(int(m) for m in re.findall(r"bytes_received:(\d+)", out))
    return (t0 + t1) / 2, total


def _sample_window(dst: Host, port: int, t_lo: float, t_hi: float) -> tuple[float, float]:
    """Sleep to ``t_lo`` and ``t_hi``, sample receiver bytes; return (bits/s, seconds)."""
    time.sleep(max(0.0, t_lo - time.monotonic()))
    a_t, a_b = _rx_bytes(dst, port)
    time.sleep(max(0.0, t_hi - time.monotonic()))
    b_t, b_b = _rx_bytes(dst, port)
    return (b_b - a_b) * 8 / (b_t - a_t), b_t - a_t


def measure_throughput(
    src: Host,
    dst: Host,
    *,
    seconds: float = 3.0,
    omit: float = 1.0,
    streams: int = 4,
    tool: str = "auto",
) -> Throughput:
    """Multi-stream TCP goodput from ``src`` to ``dst``.

    Args:
        src: sending host.
        dst: receiving host.
        seconds: measured window.
        omit: ramp-up excluded from the window (slow start).
        streams: parallel connections.
        tool: ``"iperf3"``, ``"builtin"`` or ``"auto"`` (iperf3 when installed).

    Returns:
        The goodput.

    Raises:
        TransportError: the measurement failed.
    """
    if tool == "auto":
        tool = "iperf3" if shutil.which("iperf3") else "builtin"
    if tool == "iperf3":
        return _iperf3(src, dst, seconds, omit, streams)
    return _builtin(src, dst, seconds, omit, streams)


def _listening(host: Host, port: int) -> bool:
    tcp = host.run(["cat", "/proc/net/tcp"]).stdout  # /proc/net follows the namespace
    for line in tcp.splitlines()[1:]:
        f = line.split()
        if f[1].endswith(f":{port:04X}") and f[3] == "0A":
            return True
    return False


def _iperf3(src: Host, dst: Host, seconds: float, omit: float, streams: int) -> Throughput:
    server = dst.spawn(
        ["iperf3", "-s", "-1", "-J", "-B", dst.addr, "-p", str(_PORT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    client = None
    try:
        deadline = time.monotonic() + 10.0
        while not _listening(dst, _PORT):
            if server.poll() is not None or time.monotonic() > deadline:
                raise TransportError("iperf3 server did not start", peer=dst.name)
            time.sleep(0.02)
        total = omit + seconds + 0.3
        t0 = time.monotonic()
        client = src.spawn(
            ["iperf3", "-c", dst.addr, "-p", str(_PORT), "-P", str(streams),
             "-t", f"{total:g}", "-J"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        bps, window = _sample_window(dst, _PORT, t0 + omit, t0 + omit + seconds)
        cout, cerr = client.communicate(timeout=total + 30)
        out, _ = server.communicate(timeout=10.0)
        doc = json.loads(cout or "{}")
        sdoc = json.loads(out or "{}")
        if "error" in doc or "end" not in doc or "end" not in sdoc:
            err = doc.get("error") or sdoc.get("error") or cerr[-500:]
            raise TransportError(f"iperf3 failed: {err}", peer=dst.name)
        return Throughput(
            bits_per_second=bps,
            tool="iperf3",
            streams=streams,
            seconds=window,
            retransmits=int(doc["end"]["sum_sent"].get("retransmits", -1)),
            tool_bits_per_second=float(sdoc["end"]["sum_received"]["bits_per_second"]),
        )
    finally:
        for proc in (client, server):
            if proc is not None:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()


def _builtin(src: Host, dst: Host, seconds: float, omit: float, streams: int) -> Throughput:
    with dst.inside():
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((dst.addr, 0))
    lsock.listen(streams)
    port = lsock.getsockname()[1]
    t0 = time.monotonic()
    t_end = t0 + omit + seconds + 0.3

    def receiver(conn: socket.socket) -> None:
        buf = bytearray(1 << 18)
        with conn:
            while conn.recv_into(buf):
                pass

    def sender(sock: socket.socket) -> None:
        data = memoryview(bytearray(1 << 20))
        try:
            while time.monotonic() < t_end:
                sock.send(data)
        except OSError:
            pass
        finally:
            sock.close()

    threads = []
    try:
        for _ in range(streams):
            with src.inside():
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.connect((dst.addr, port))
            threads.append(threading.Thread(target=sender, args=(s,), daemon=True))
            c, _ = lsock.accept()
            threads.append(threading.Thread(target=receiver, args=(c,), daemon=True))
        for t in threads:
            t.start()
        bps, window = _sample_window(dst, port, t0 + omit, t0 + omit + seconds)
        for t in threads:
            t.join(timeout=30)
    finally:
        lsock.close()
    return Throughput(bps, "builtin", streams, window)


def _delta(after: dict[str, Any] | None, before: dict[str, Any] | None) -> dict[str, float]:
    if not after or not before:
        return {}
    wall = after["wall"] - before["wall"]
    out = {"cpu_fraction": (after["cpu"] - before["cpu"]) / wall if wall > 0 else 0.0}
    rel = late = 0
    late_max = 0.0
    for d in ("a_to_b", "b_to_a"):
        rel += after[d]["released"] - before[d]["released"]
        late += after[d]["late"] - before[d]["late"]
        late_max = max(late_max, after[d]["late_max_ms"])
    out["late_fraction"] = late / rel if rel else 0.0
    out["late_max_ms"] = late_max
    out["packets"] = rel
    return out


def check(
    tb: Testbed,
    *,
    seconds: float = 3.0,
    omit: float = 1.0,
    streams: int = 4,
    rtt_probes: int = 20,
    tool: str = "auto",
) -> dict[str, Any]:
    """Measure idle RTT, throughput and (if configured) loss DC-A -> DC-B; run the self-checks.

    Self-checks (any one failing sets ``valid`` false): the idle RTT is within
    10% + 1 ms of the configured RTT; during the throughput run the forwarder
    used under 90% of a core and released under 1% of packets more than 1 ms
    late; the WAN devices dropped nothing outside the emulated queue; the
    forwarder is still alive.

    Returns:
        The summary dict (``backend``, ``rtt_measured_ms``, ``rate_measured_mbit``,
        ``rate_ratio``, ``valid``, ``self_checks``...).
    """
    spec = tb.spec
    rtts = measure_rtt(tb.p, tb.md, count=rtt_probes)
    rtt_cfg = spec.rtt
    rtt_med = statistics.median(rtts) if rtts else math.nan
    drops0 = tb.wan_drops()
    fw0 = tb.forwarder_stats()
    tp = measure_throughput(tb.p, tb.md, seconds=seconds, omit=omit, streams=streams, tool=tool)
    time.sleep(0.3)  # let a stats period pass
    fw1 = tb.forwarder_stats()
    drops1 = tb.wan_drops()
    fw = _delta(fw1, fw0)
    rate = spec.a_to_b.rate
    checks: dict[str, dict[str, Any]] = {
        "rtt_error": {
            "value_ms": abs(rtt_med - rtt_cfg) * 1e3,
            "limit_ms": rtt_tolerance(rtt_cfg) * 1e3,
        },
        "wan_tx_drops": {"value": sum(drops1.values()) - sum(drops0.values()), "limit": 0},
        "forwarder_alive": {"value": tb.forwarder_alive()},
    }
    checks["rtt_error"]["ok"] = checks["rtt_error"]["value_ms"] <= checks["rtt_error"]["limit_ms"]
    checks["wan_tx_drops"]["ok"] = checks["wan_tx_drops"]["value"] <= 0
    checks["forwarder_alive"]["ok"] = bool(checks["forwarder_alive"]["value"])
    if tb.backend == "tun":
        checks["forwarder_cpu"] = {
            "value": fw.get("cpu_fraction", math.nan),
            "limit": K_CPU_LIMIT,
            "ok": fw.get("cpu_fraction", 1.0) <= K_CPU_LIMIT,
        }
        checks["forwarder_late"] = {
            "value": fw.get("late_fraction", math.nan),
            "limit": K_LATE_FRACTION,
            "late_max_ms": fw.get("late_max_ms", math.nan),
            "ok": fw.get("late_fraction", 1.0) <= K_LATE_FRACTION,
        }
    loss_cfg = spec.a_to_b.mean_loss()
    loss: dict[str, Any] = {}
    if loss_cfg > 0:
        # Paced at half the bottleneck rate so queue drops do not count as loss.
        size = min(1000, spec.mtu - 28)
        pps = 20000.0 if not rate else min(20000.0, 0.5 * rate / 8 / (size + 28))
        sent, got = measure_loss(tb.p, tb.md, packets=4000, size=size, pps=pps)
        sd = math.sqrt(sent * loss_cfg * (1 - loss_cfg))
        loss = {
            "loss_measured": (sent - got) / sent,
            "loss_within_bounds": abs((sent - got) - sent * loss_cfg) <= 4.5 * sd + 1,
        }
    cc = tb.p.run(["sysctl", "-n", "net.ipv4.tcp_congestion_control"]).stdout.strip()
    return {
        "backend": tb.backend,
        "mtu": spec.mtu,
        "rtt_configured_ms": rtt_cfg * 1e3,
        "rtt_measured_ms": rtt_med * 1e3,
        "rtt_min_ms": min(rtts) * 1e3 if rtts else math.nan,
        "rtt_probes": len(rtts),
        "rate_configured_mbit": rate / 1e6 if rate else None,
        "rate_measured_mbit": tp.bits_per_second / 1e6,
        "rate_ratio": tp.bits_per_second / rate if rate else None,
        "loss_configured": loss_cfg,
        **loss,
        "throughput_tool": tp.tool,
        "rate_tool_report_mbit": (
            tp.tool_bits_per_second / 1e6 if tp.tool_bits_per_second else None
        ),
        "streams": tp.streams,
        "retransmits": tp.retransmits,
        "congestion_control": cc,
        "forwarder": fw,
        "self_checks": checks,
        "valid": all(c["ok"] for c in checks.values()),
    }
