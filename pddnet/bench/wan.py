"""WAN goodput: pddnet vs iperf3 -P N vs single-stream TCP, and small transfers behind bulk.

Three parts, each in the same run:

* loopback: pddnet vs a plain multi-stream ``socket.sendall``/``recv_into``
  sender (same N), unshaped; gives ``loopback_ratio_vs_raw_tcp``;
* emulated WAN links (``pddnet.emu``): pddnet with N streams vs ``iperf3 -P N``
  vs one plain TCP stream, each sending about ``--seconds`` worth of the link;
  reports goodput, CPU seconds per GB (sender + receiver) and TCP-retransmitted
  bytes;
* priority: 256 KiB high-priority transfers issued while a bulk transfer
  saturates the link, with pddnet's scheduler and with FIFO; completion-time
  percentiles (from ``start`` until the receiver verified every byte);
* TLS: on loopback and on each emulated link, pddnet again over mutual TLS
  (throwaway certificates, the challenge-response off on both rows), in the
  same run: ``pddnet+TLS`` rows and the ``tls_goodput_ratio`` /
  ``tls_cpu_per_gb_ratio`` summary keys (``--no-tls`` skips it).

``--quick`` uses one link (30 ms RTT, 0.1 % loss, 1 Gbit/s, MTU 9000); the full
mode sweeps RTT {0, 30, 80} ms x loss {0, 0.1, 1} % x rate {200 Mbit/s, 1 Gbit/s}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .._errors import RemoteCallError, TransportError
from . import _wan_peer as peer
from ._common import (
    Progress,
    add_common_arguments,
    percentiles,
    print_table,
    pyplot,
    run_install,
    write_report,
)

K_QUICK_LINK = {"rtt_ms": 30.0, "loss": 0.001, "rate_mbit": 1000.0, "mtu": 9000}
K_CPU_WAIT = 0.1  # the forwarder waiting for a CPU over this fraction of a run: not the link
K_SHORT = 0.9  # a run whose goodput is under this fraction of the link rate fell short
K_TCP_IP_HEADERS = 52  # IPv4 20 + TCP 20 + timestamps 12: MSS = MTU - 52
K_IPERF3_HOW = (
    "install it (Debian/Ubuntu: apt-get install iperf3; Fedora: dnf install iperf3) "
    "or rerun as root with --install-peers"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument(
        "--streams",
        type=int,
        default=None,
        help="N for pddnet and iperf3 -P (default: pddnet's for --cc: 8 bbr, 16 cubic)",
    )
    parser.add_argument("--cc", default="bbr", help="congestion control for every sender")
    parser.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="pddnet chunk size, bytes (default: the sender's per-path choice)",
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="target seconds per run")
    parser.add_argument("--loopback-mb", type=int, default=1024, help="loopback bytes per run")
    parser.add_argument("--repeat", type=int, default=3, help="loopback repetitions")
    parser.add_argument("--no-emu", action="store_true", help="loopback only")
    parser.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="RTT_MS,LOSS,MBIT[,JITTER_MS]",
        help="run only these links (e.g. 30,0.001,1000 or 30,0.001,1000,5); repeatable",
    )
    parser.add_argument("--no-loopback", action="store_true", help="skip the loopback part")
    parser.add_argument(
        "--no-baselines", action="store_true", help="emulated links: pddnet only (no iperf3/TCP)"
    )
    parser.add_argument(
        "--priority-all", action="store_true", help="run the priority scenario on every link"
    )
    parser.add_argument(
        "--urgent-pacing",
        type=float,
        default=None,
        help="pace bulk to this fraction of the peak rate while urgent transfers run "
        "(default: the sender's, 0.9; 0: off)",
    )
    parser.add_argument("--no-fifo", action="store_true", help="priority scenario: skip FIFO")
    parser.add_argument(
        "--notsent-lowat",
        type=int,
        default=None,
        help="pddnet's TCP_NOTSENT_LOWAT per stream, bytes (default: the sender's, 256 KiB;"
        " bulk streams use at least 1 MiB while no urgent transfer runs)",
    )
    parser.add_argument("--pacer", default="adaptive", help="pddnet pacer (adaptive, fixed)")
    parser.add_argument(
        "--pacer-opt",
        action="append",
        default=[],
        metavar="K=V",
        help="pacer option (float), repeatable: --pacer-opt slack=1.25",
    )
    parser.add_argument(
        "--small",
        type=int,
        default=100,
        help="small transfers per priority run (>= 100 for a p99 that is not the maximum)",
    )
    parser.add_argument(
        "--small-interval",
        type=float,
        default=0.03,
        help="seconds between the small transfers' starts (the bulk runs long enough)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="paired pddnet/iperf3 rounds per link, alternating which goes first",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unmeasured rounds per link before them (each sender once; default 1)",
    )
    parser.add_argument(
        "--install-peers",
        action="store_true",
        help="install a missing iperf3 with apt-get (root)",
    )
    parser.add_argument("--no-tls", action="store_true", help="skip the pddnet+TLS rows")


def _popts(args: argparse.Namespace) -> dict[str, float]:
    return {k: float(v) for k, v in (o.split("=", 1) for o in args.pacer_opt)}


def _free_ports(n: int) -> list[int]:
    """``n`` ports, each free together with the next one (a pdd receiver also takes
    PORT + 1 for its grant service), all pairs distinct."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s, socket.socket() as t:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            if any(abs(port - p) <= 1 for p in ports):
                continue
            try:
                t.bind(("0.0.0.0", port + 1))
            except OSError:
                continue
            ports.append(port)
    return ports


@contextlib.contextmanager
def _server(spawn: Callable[..., subprocess.Popen[Any]], argv: list[str]) -> Iterator[None]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = spawn(argv, stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "READY" not in line:
            raise RuntimeError(f"{argv[:4]} failed to start: {line!r}")
        yield
    finally:
        proc.kill()
        proc.wait()


def _peer_argv(role: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pddnet.bench._wan_peer", role, str(port), *extra]


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9 if seconds > 0 else float("nan")


def _row(name: str, link: str, nbytes: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One sender's row: medians over ``runs`` (each of ``bytes``, default ``nbytes``).

    CPU seconds per GB come per side (``cpu_tx_s_per_gb``: the sending process,
    ``cpu_rx_s_per_gb``: the receiving one) and together (``cpu_s_per_gb``, the
    median of each run's sum), with the kernel's share of the sum (``cpu_sys_share``)
    where the run measured it.
    """
    size = [float(r.get("bytes", nbytes)) for r in runs]
    extra = {"chunk_size": runs[0]["chunk_size"]} if "chunk_size" in runs[0] else {}

    def per_gb(f: Callable[[dict[str, Any]], float]) -> float:
        return float(np.median([f(r) / (b / 1e9) for b, r in zip(size, runs, strict=True)]))

    if all("cpu_tx_sys" in r for r in runs):
        extra["cpu_sys_share"] = float(
            np.median(
                [
                    (r["cpu_tx_sys"] + r.get("cpu_rx_sys", 0.0))
                    / max(r["cpu_tx"] + r.get("cpu_rx", 0.0), 1e-9)
                    for r in runs
                ]
            )
        )
    return {
        "link": link,
        "sender": name,
        "goodput_gbps": float(
            np.median([_gbps(b, r["seconds"]) for b, r in zip(size, runs, strict=True)])
        ),
        "cpu_s_per_gb": per_gb(lambda r: r["cpu_tx"] + r.get("cpu_rx", 0.0)),
        "cpu_tx_s_per_gb": per_gb(lambda r: r["cpu_tx"]),
        "cpu_rx_s_per_gb": per_gb(lambda r: r.get("cpu_rx", 0.0)),
        "retrans_mb": float(np.median([r["retrans"] for r in runs])) / 1e6,
        # tcp_info's bytes_retrans (pddnet, plain TCP) is exact; iperf3 counts
        # segments, which _iperf3 turns into an upper bound of one MSS each
        "retrans_exact": "retrans_segments" not in runs[0],
        "runs": len(runs),
        **extra,
    }


@contextlib.contextmanager
def _tls_server(
    spawn: Callable[..., subprocess.Popen[Any]], port: int, tls_dir: str | None
) -> Iterator[None]:
    """A TLS pdd receiver on ``port`` if ``tls_dir`` is set, else nothing."""
    if tls_dir is None:
        yield
        return
    with _server(spawn, _peer_argv("pdd-rx", port, tls_dir)):
        yield


def loopback(args: argparse.Namespace, bar: Progress) -> list[dict[str, Any]]:
    n = args.streams
    nbytes = (256 if args.quick else args.loopback_mb) << 20
    raw_port, pdd_port, tls_port = _free_ports(3)
    raw_runs, pdd_runs, tls_runs = [], [], []
    with (
        _server(subprocess.Popen, _peer_argv("raw-rx", raw_port, str(nbytes))),
        _server(subprocess.Popen, _peer_argv("pdd-rx", pdd_port)),
        _tls_server(subprocess.Popen, tls_port, args.tls_dir),
    ):
        for _ in range(args.repeat):  # interleaved, so machine noise hits all alike
            raw_runs.append(peer.raw_send("127.0.0.1", raw_port, nbytes, n, args.cc))
            res = peer.pdd_send(
                "127.0.0.1", pdd_port, nbytes, n, args.cc, chunk_size=args.chunk, pacer=args.pacer
            )
            pdd_runs += res["runs"]
            if args.tls_dir is not None:
                res = peer.pdd_send(
                    "127.0.0.1",
                    tls_port,
                    nbytes,
                    n,
                    args.cc,
                    chunk_size=args.chunk,
                    pacer=args.pacer,
                    tls_dir=args.tls_dir,
                )
                tls_runs += res["runs"]
            bar.advance(note="loopback")
    rows = [
        _row(f"plain TCP x{n}", "loopback", nbytes, raw_runs),
        _row(f"pddnet x{n}", "loopback", nbytes, pdd_runs),
    ]
    if tls_runs:
        rows.append(_row(f"pddnet+TLS x{n}", "loopback", nbytes, tls_runs))
    return rows


def _link_name(link: dict[str, float]) -> str:
    name = f"{link['rtt_ms']:g}ms/{link['loss'] * 100:g}%/{link['rate_mbit']:g}M"
    if link.get("jitter_ms"):
        name += f"/j{link['jitter_ms']:g}ms"
    return name


def _parse_link(text: str) -> dict[str, float]:
    parts = [float(x) for x in text.split(",")]
    if len(parts) not in (3, 4):
        raise SystemExit(f"--link wants RTT_MS,LOSS,MBIT[,JITTER_MS], got {text!r}")
    link = {"rtt_ms": parts[0], "loss": parts[1], "rate_mbit": parts[2], "mtu": 9000}
    if len(parts) == 4:
        link["jitter_ms"] = parts[3]
    return link


def _wait_rusage(proc: subprocess.Popen[Any], timeout: float) -> tuple[float, bool]:
    """Reap ``proc`` (killed after ``timeout`` s) and return its CPU seconds
    (``wait4``: the process and its threads, its whole life) and whether it had
    to be killed."""
    deadline = time.monotonic() + timeout
    killed = False
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            killed = True
            pid, status, ru = os.wait4(proc.pid, 0)
            break
        time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return ru.ru_utime + ru.ru_stime, killed


def _iperf3(wan: Any, n: int, seconds: float, cc: str, mtu: int) -> dict[str, Any]:
    """One ``iperf3 -P n`` run.

    Its CPU (``cpu_tx``/``cpu_rx``, ``_sys`` the kernel's share) is what iperf3's
    client and server processes report from their own ``getrusage`` over the test,
    the window pddnet's processes are measured over; ``cpu_*_proc`` is each
    process's whole life (``wait4``: start-up and the control connection too), an
    upper bound that checks the report. The ratios use the report (the lower)."""
    port = 5201
    server = wan.md.spawn(["iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    argv = ["iperf3", "-c", wan.md.addr, "-p", str(port), "-P", str(n)]
    # whole seconds: iperf3 reads "0.5" as 0, forever
    argv += ["-t", str(max(1, round(seconds))), "-C", cc, "-J"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            client = wan.p.spawn(argv, stdout=out, stderr=err, text=True)
            client_cpu, killed = _wait_rusage(client, seconds + 30)
        finally:
            server_cpu, _ = _wait_rusage(server, 10.0)
        if killed:
            raise subprocess.TimeoutExpired(argv, seconds + 30)
        out.seek(0)
        err.seek(0)
        if client.returncode != 0:
            raise TransportError(
                f"iperf3 client exited {client.returncode}: {err.read().strip()[-500:]}"
            )
        text = out.read()
    rep = json.loads(text)
    end = rep["end"]
    secs = float(end["sum_received"]["seconds"])
    nbytes = float(end["sum_received"]["bytes"])
    cpu = end.get("cpu_utilization_percent", {})
    segments = int(end["sum_sent"].get("retransmits", 0))
    return {
        "bytes": nbytes,
        "seconds": secs,
        "cpu_tx": cpu.get("host_total", 0.0) / 100 * secs,
        "cpu_rx": cpu.get("remote_total", 0.0) / 100 * secs,
        "cpu_tx_sys": cpu.get("host_system", 0.0) / 100 * secs,
        "cpu_rx_sys": cpu.get("remote_system", 0.0) / 100 * secs,
        "cpu_tx_proc": client_cpu,
        "cpu_rx_proc": server_cpu,
        # iperf3 reports segments, not bytes: at most one MSS each (MTU - IP/TCP
        # headers with timestamps), so this is an upper bound; see _row
        "retrans": segments * (mtu - K_TCP_IP_HEADERS),
        "retrans_segments": segments,
    }


def _emu_snapshot(wan: Any) -> dict[str, Any]:
    pid = wan.forwarder_pid
    return {
        "forwarder": wan.forwarder_stats(),
        "drops": sum(wan.wan_drops().values()),
        "wait": peer.run_delay(pid) if pid else 0.0,
    }


def _emu_delta(wan: Any, before: dict[str, Any]) -> dict[str, Any]:
    """What the emulator did since ``before``: the forwarder's CPU share, late
    packets and the WAN devices' drops (the self-checks of ``pddnet wan check``)."""
    from ..emu._forwarder import K_STATS_PERIOD
    from ..emu._measure import _delta

    time.sleep(K_STATS_PERIOD + 0.05)  # a stats period that covers the run's end
    after = _emu_snapshot(wan)
    out: dict[str, Any] = {
        **_delta(after["forwarder"], before["forwarder"]),
        "tx_drops": after["drops"] - before["drops"],
        "alive": wan.forwarder_alive(),
        "link_bytes": _link_bytes(after["forwarder"]) - _link_bytes(before["forwarder"]),
        "cpu_wait_s": after["wait"] - before["wait"],
        "load1": os.getloadavg()[0],
    }
    if before["forwarder"] and after["forwarder"]:
        out["wall_s"] = after["forwarder"]["wall"] - before["forwarder"]["wall"]
    if before["forwarder"] and "late_max_ms" in out:
        # the forwarder keeps one maximum for its life: this run's only if it grew
        grew = out["late_max_ms"] > max(
            before["forwarder"][d]["late_max_ms"] for d in ("a_to_b", "b_to_a")
        )
        out["late_max_ms"] = out["late_max_ms"] if grew else None
    return out


def _link_bytes(stats: dict[str, Any] | None) -> int:
    return int(stats["a_to_b"]["bytes_out"]) if stats else 0


def where_time_went(
    goodput: float,
    link_utilization: float | None,
    fault: str | None,
    rwnd_limited: float,
    cpu_wait: dict[str, float],
) -> str | None:
    """Where a run that fell short of the link rate lost its time, or ``None``.

    Args:
        goodput: payload bits/s over the link rate.
        link_utilization: bits the emulated link carried DC-A -> DC-B during the
            run over (rate x the run's seconds); ``None`` without forwarder stats.
        fault: :func:`emulator_fault` of the run.
        rwnd_limited: the fraction of the streams' time that the receiver's
            window held the sender back (``TCP_INFO``; 0 if unknown).
        cpu_wait: per process (``sender``, ``receiver``), its threads' time
            waiting for a CPU while runnable over the run's seconds (reported
            with the verdict, not judged: there is no calibrated threshold).
    """
    if fault:
        return f"emulator: {fault}"
    if goodput >= K_SHORT or link_utilization is None:
        return None
    if link_utilization >= K_SHORT:
        return f"overhead: the link was full ({link_utilization:.2f}), payload {goodput:.2f}"
    idle = f"the link idled (carried {link_utilization:.2f} of its rate)"
    if cpu_wait:  # evidence, not a verdict: healthy runs here waited 0.07-0.57 too
        idle += "; waited for a CPU: " + ", ".join(f"{k} {v:.0%}" for k, v in cpu_wait.items())
    who = "receiver window" if rwnd_limited > 0.1 else "sender"
    return f"{who}: {idle}"


def emulator_fault(emu: dict[str, Any]) -> str | None:
    """Why the emulated link was not the configured one during a run, or ``None``.

    The criteria are ``pddnet wan check``'s self-checks: the forwarder used more
    than 90 % of a core or released more than 1 % of packets over 1 ms late (the
    delay line ran behind: extra RTT and jitter nobody configured), the WAN
    devices dropped packets outside the emulated queue (extra loss), or it died;
    and one more: it waited for a CPU more than 10 % of the time (packets then sit
    unread in the TUN queue, a delay its lateness count cannot see).
    """
    from ..emu._measure import K_CPU_LIMIT, K_LATE_FRACTION

    why = []
    if not emu.get("alive", True):
        why.append("forwarder died")
    if emu.get("cpu_fraction", 0.0) > K_CPU_LIMIT:
        why.append(f"forwarder used {emu['cpu_fraction']:.0%} of a core")
    if emu.get("wall_s") and emu.get("cpu_wait_s", 0.0) > K_CPU_WAIT * emu["wall_s"]:
        why.append(f"forwarder waited {emu['cpu_wait_s'] / emu['wall_s']:.0%} of the run for a CPU")
    if emu.get("late_fraction", 0.0) > K_LATE_FRACTION:
        why.append(f"forwarder released {emu['late_fraction']:.1%} of packets > 1 ms late")
    if emu.get("tx_drops", 0) > 0:
        why.append(f"{emu['tx_drops']} packets dropped outside the emulated queue")
    return "; ".join(why) or None


def round_order(r: int, names: list[str]) -> list[str]:
    """The senders of paired round ``r`` (0-based), rotated so each goes first in turn."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def paired_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The pddnet/iperf3 ratios (goodput, and CPU seconds per GB) over paired rounds.

    Args:
        rounds: one dict per round: ``pddnet`` and ``iperf3`` goodput (``None`` if
            that run did not happen), optionally ``pddnet_cpu`` and ``iperf3_cpu``
            (CPU seconds per GB, sender + receiver processes), and ``fault`` (why
            the emulator spoilt the round, or ``None``).

    Returns:
        ``rounds`` (rounds kept with both runs), ``rounds_discarded`` (spoilt by
        the emulator, with ``discarded`` their reasons), ``ratio_vs_iperf3``
        (median of the kept rounds' goodput ratios), ``ratio_vs_iperf3_min`` (the
        worst) and ``ratio_vs_iperf3_rounds``; ``cpu_per_gb_ratio_vs_iperf3``
        (median of the kept rounds' CPU-per-GB ratios), ``..._max`` (the worst)
        and ``..._rounds``. A ratio is ``None`` without a kept pair.
    """
    kept = [r for r in rounds if not r["fault"]]
    ratios = [r["pddnet"] / r["iperf3"] for r in kept if r["pddnet"] and r["iperf3"]]
    cpu = [
        r["pddnet_cpu"] / r["iperf3_cpu"]
        for r in kept
        if r["pddnet"] and r["iperf3"] and r.get("pddnet_cpu") and r.get("iperf3_cpu")
    ]
    return {
        "rounds": len(ratios),
        "rounds_discarded": len(rounds) - len(kept),
        "discarded": [r["fault"] for r in rounds if r["fault"]],
        "ratio_vs_iperf3": float(np.median(ratios)) if ratios else None,
        "ratio_vs_iperf3_min": min(ratios) if ratios else None,
        "ratio_vs_iperf3_rounds": ratios,
        "cpu_per_gb_ratio_vs_iperf3": float(np.median(cpu)) if cpu else None,
        "cpu_per_gb_ratio_vs_iperf3_max": max(cpu) if cpu else None,
        "cpu_per_gb_ratio_vs_iperf3_rounds": cpu,
    }


def _pdd_run(
    args: argparse.Namespace, wan: Any, port: int, nbytes: int, *, tls: bool = False
) -> dict[str, Any]:
    res = wan.p.call(
        peer.pdd_send,
        wan.md.addr,
        port,
        nbytes,
        args.streams,
        args.cc,
        chunk_size=args.chunk,
        pacer=args.pacer,
        pacer_options=_popts(args),
        notsent_lowat=args.notsent_lowat,
        tls_dir=args.tls_dir if tls else None,
        timeout=args.seconds * 20 + 60,
    )
    run: dict[str, Any] = res["runs"][0]
    return {"bytes": nbytes, **run}


def _round_fault(rec: dict[str, Any]) -> str | None:
    faults = [
        f"{who}: {rec[who]['emulator_fault']}"
        for who in rec["order"]
        if rec[who] and rec[who]["emulator_fault"]
    ]
    return "; ".join(faults) or None


def _goodput(run: dict[str, Any] | None) -> float | None:
    return _gbps(run["bytes"], run["seconds"]) if run else None


def cpu_per_gb(run: dict[str, Any] | None) -> float | None:
    """CPU seconds per GB of payload of one run, sender + receiver processes."""
    if not run or not run["bytes"]:
        return None
    return (float(run["cpu_tx"]) + float(run.get("cpu_rx", 0.0))) / (run["bytes"] / 1e9)


def emulated(
    args: argparse.Namespace,
    link: dict[str, float],
    bar: Progress,
    priority: bool,
    errors: dict[str, str],
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[str, Any]]:
    """One emulated link: paired, alternating pddnet/iperf3 rounds, then one
    pddnet+TLS and one single-stream run, then the priority scenario.

    Every run records what the emulator did meanwhile (``emu``); a round in which
    it did not hold the configured link (:func:`emulator_fault`) is discarded,
    counted and reported. A sender that fails is recorded in ``errors``.

    Returns:
        The rows, the priority results (or ``None``) and the rounds'
        :func:`paired_summary` with every round's record under ``log``.
    """
    from ..emu import emulated_wan

    n = args.streams
    rate = link["rate_mbit"] * 1e6
    nbytes = int(rate / 8 * args.seconds)
    name = _link_name(link)
    rows: list[dict[str, Any]] = []
    prio: dict[str, Any] | None = None
    with emulated_wan(
        f"{link['rtt_ms']}ms",
        rate=f"{link['rate_mbit']:g}mbit",
        loss=link["loss"],
        jitter=f"{link.get('jitter_ms', 0.0)}ms",
        mtu=int(link["mtu"]),
        # the forwarder on a CPU of its own, senders and receivers on the others:
        # sharing, it ran late in every round here (docs/wan-emulation.md)
        isolate_cpu=True,
    ) as wan:
        # Persistent streams sit idle between transfers: keep their congestion
        # window (the recommended setting for pddnet hosts; see docs/wan.md).
        for host in (wan.p, wan.md):
            host.run(["sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"], check=False)
        md = wan.md.addr
        raw_port, pdd_port, tls_port = 6000, 6100, 6200

        def measured(what: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
            """``run()`` plus what the emulator did meanwhile; None if it failed."""
            before = _emu_snapshot(wan)
            try:
                out = run()
            except (TransportError, RemoteCallError, subprocess.TimeoutExpired) as exc:
                key = f"{name} {what}"
                errors[key] = f"{type(exc).__name__}: {exc}"[:2000]
                print(f"{key}: {errors[key][:300]}", file=sys.stderr)
                return None
            out["emu"] = emu = _emu_delta(wan, before)
            out["emulator_fault"] = emulator_fault(emu)
            util = (
                emu["link_bytes"] * 8 / (rate * out["seconds"]) if "cpu_fraction" in emu else None
            )
            tcp = out.get("tcp_time") or {}
            busy = tcp.get("streams", 0) * out["seconds"]
            out["lost_to"] = where_time_went(
                _gbps(out["bytes"], out["seconds"]) * 1e9 / rate,
                util,
                out["emulator_fault"],
                tcp.get("rwnd_limited_s", 0.0) / busy if busy else 0.0,
                {k: v / out["seconds"] for k, v in out.get("cpu_wait", {}).items()},
            )
            emu["link_utilization"] = util
            if out["lost_to"]:
                print(f"{name} {what}: short: {out['lost_to']}", file=sys.stderr)
            return out

        with (
            _server(wan.md.spawn, _peer_argv("raw-rx", raw_port, str(nbytes))),
            _server(wan.md.spawn, _peer_argv("pdd-rx", pdd_port)),
            _tls_server(wan.md.spawn, tls_port, args.tls_dir),
        ):
            senders: dict[str, Callable[[], dict[str, Any]]] = {
                "pddnet": lambda: _pdd_run(args, wan, pdd_port, nbytes),
                "iperf3": lambda: _iperf3(wan, n, args.seconds, args.cc, int(link["mtu"])),
            }
            names = ["pddnet"]
            if not args.no_baselines and "iperf3" not in args.missing:
                names.append("iperf3")
            # Unmeasured first: on a machine that sat idle the first sender
            # processes paid 2-7x the CPU per GB of later ones, pddnet and iperf3
            # alike (likely this VM's free page reporting: pages handed back to
            # the host fault in again, charged to the guest thread touching them),
            # and round 1 always starts with pddnet (docs/wan.md, "Session 12").
            warmup: list[dict[str, Any]] = []
            for w in range(args.warmup):
                warm: dict[str, Any] = {"order": names}
                for who in names:
                    res = measured(f"warm-up {who}", senders[who])
                    warm[who] = {"goodput_gbps": _goodput(res), "cpu_s_per_gb": cpu_per_gb(res)}
                    bar.advance(note=f"{name} warm-up {w + 1} {who}")
                warmup.append(warm)
            log: list[dict[str, Any]] = []
            for r in range(args.rounds):
                rec: dict[str, Any] = {"round": r + 1, "order": round_order(r, names)}
                for who in rec["order"]:
                    rec[who] = measured(f"round {r + 1} {who}", senders[who])
                    bar.advance(note=f"{name} round {r + 1} {who}")
                rec["fault"] = _round_fault(rec)
                log.append(rec)
            paired = paired_summary(
                [
                    {
                        **{w: _goodput(rec.get(w)) for w in senders},
                        **{f"{w}_cpu": cpu_per_gb(rec.get(w)) for w in senders},
                        "fault": rec["fault"],
                    }
                    for rec in log
                ]
            )
            paired["log"] = log
            paired["warmup"] = warmup
            paired["emulator_cpus"] = {
                "forwarder": wan.forwarder_cpu,
                "hosts": sorted(wan.host_cpus) if wan.host_cpus is not None else None,
            }
            labels = {"pddnet": f"pddnet x{n}", "iperf3": f"iperf3 -P {n}"}
            for who in names:
                runs = [rec[who] for rec in log if rec[who]]
                kept = [rec[who] for rec in log if rec[who] and not rec["fault"]]
                if runs:
                    row = _row(labels[who], name, nbytes, kept or runs)
                    if not kept:  # every round spoilt: shown, marked, not in the ratios
                        row["emulator_fault"] = True
                    if who == "pddnet":
                        row["resent_mb"] = (
                            float(np.median([x["resent"] for x in kept or runs])) / 1e6
                        )
                        row["pacing"] = (kept or runs)[0]["pacing"]
                    rows.append(row)
            if args.tls_dir is not None:
                res = measured(
                    "pddnet+TLS", lambda: _pdd_run(args, wan, tls_port, nbytes, tls=True)
                )
                if res:
                    row = _row(f"pddnet+TLS x{n}", name, nbytes, [res])
                    row["resent_mb"] = res["resent"] / 1e6
                    rows.append(row)
                bar.advance(note=f"{name} pddnet+TLS")
            if not args.no_baselines:
                single = measured(
                    "plain TCP x1",
                    lambda: wan.p.call(
                        peer.raw_send,
                        md,
                        raw_port,
                        nbytes // 2,
                        1,
                        args.cc,
                        timeout=args.seconds * 40 + 60,
                    ),
                )
                if single:
                    rows.append(_row("plain TCP x1", name, nbytes // 2, [single]))
            bar.advance(note=f"{name} single")
            if priority:
                prio = {"link": name, "rtt_s": link["rtt_ms"] / 1e3}
                interval = args.small_interval
                small_delay = 0.3
                # long enough that every small transfer starts while bulk still runs
                bulk_s = max(args.seconds * 0.6, small_delay + args.small * interval + 0.5)
                bulk = int(rate / 8 * bulk_s)
                for policy in ("priority",) if args.no_fifo else ("priority", "fifo"):
                    r = wan.p.call(
                        peer.pdd_send,
                        md,
                        pdd_port,
                        bulk,
                        n,
                        args.cc,
                        chunk_size=args.chunk,
                        policy=policy,
                        small=args.small,
                        small_interval=interval,
                        pacer=args.pacer,
                        pacer_options=_popts(args),
                        urgent_pacing=args.urgent_pacing,
                        notsent_lowat=args.notsent_lowat,
                        small_delay=small_delay,
                        # pddnet again on the same, now warm, connections: a
                        # long-lived sender's bulk streams are past BBR's startup
                        repeat=2 if policy == "priority" else 1,
                        timeout=bulk_s * 40 + 60,
                    )
                    for key, run in zip((policy, f"{policy}_warm"), r["runs"], strict=False):
                        prio[key] = {
                            "small_s": run["small_s"],
                            "bulk_goodput_gbps": _gbps(bulk, run["seconds"]),
                            **percentiles(run["small_s"]),
                        }
                    bar.advance(note=f"{name} {policy}")
    return rows, prio, paired


def _plot(path: str, rows: list[dict[str, Any]], prio: dict[str, Any] | None) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    links = list(dict.fromkeys(r["link"] for r in rows))
    senders = list(dict.fromkeys(r["sender"] for r in rows))
    width = 0.8 / max(len(senders), 1)
    for i, s in enumerate(senders):
        vals = [
            next((r["goodput_gbps"] for r in rows if r["link"] == lk and r["sender"] == s), 0)
            for lk in links
        ]
        axes[0].bar(np.arange(len(links)) + i * width, vals, width, label=s)
    axes[0].set_xticks(np.arange(len(links)) + 0.4 - width / 2, links, rotation=30, ha="right")
    axes[0].set_ylabel("goodput, Gbit/s")
    axes[0].legend(fontsize=8)
    axes[0].set_title("goodput per link (RTT/loss/rate)")
    if prio:
        for policy in ("priority", "fifo"):
            if policy not in prio:
                continue
            xs = np.sort(np.asarray(prio[policy]["small_s"]) * 1e3)
            axes[1].step(xs, np.arange(1, xs.size + 1) / max(xs.size, 1), label=policy)
        axes[1].set_xscale("log")
        axes[1].set_xlabel("256 KiB completion time during bulk, ms")
        axes[1].set_ylabel("CDF")
        axes[1].legend()
        axes[1].set_title(f"small transfers behind bulk ({prio['link']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _tls_summary(rows: list[dict[str, Any]], link: str, prefix: str) -> dict[str, float]:
    """TLS's cost on one link: goodput and CPU s/GB of pddnet+TLS over plain pddnet."""
    by = {r["sender"].split()[0]: r for r in rows if r["link"] == link}
    if "pddnet" not in by or "pddnet+TLS" not in by:
        return {}
    plain, tls = by["pddnet"], by["pddnet+TLS"]
    return {
        f"{prefix}tls_goodput_ratio": tls["goodput_gbps"] / plain["goodput_gbps"],
        f"{prefix}tls_cpu_per_gb_ratio": tls["cpu_s_per_gb"] / plain["cpu_s_per_gb"],
    }


def missing_iperf3(install: bool, errors: dict[str, str]) -> str | None:
    """Why iperf3 cannot run here (with how to get it), or ``None`` if it can.

    With ``install`` (``--install-peers``) and root, a missing iperf3 is first
    installed with apt-get; what went wrong is left in ``errors``.
    """
    if shutil.which("iperf3"):
        return None
    if install:
        if os.geteuid() != 0:
            errors["iperf3"] = "--install-peers installs iperf3 with apt-get, which needs root"
        elif not shutil.which("apt-get"):
            errors["iperf3"] = "--install-peers: no apt-get on this machine"
        elif run_install(
            [["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "iperf3"]], errors
        ) and shutil.which("iperf3"):
            return None
    return f"iperf3 not found on PATH; {K_IPERF3_HOW}"


def main(args: argparse.Namespace) -> int:
    if args.streams is None:
        from ..transport.wan import default_streams

        args.streams = default_streams(args.cc)
    links: list[dict[str, float]] = []
    if not args.no_emu:
        from ..emu import unavailable_reason

        why = unavailable_reason()
        if why:
            print(f"emulated WAN unavailable ({why}); loopback only", file=sys.stderr)
        elif args.link:
            links = [_parse_link(x) for x in args.link]
        elif args.quick:
            links = [dict(K_QUICK_LINK)]
        else:
            links = [
                {"rtt_ms": rtt, "loss": loss, "rate_mbit": rate, "mtu": 9000}
                for rtt in (0.0, 30.0, 80.0)
                for loss in (0.0, 0.001, 0.01)
                for rate in (200.0, 1000.0)
            ]
    args.tls_dir = None
    tmp = tempfile.TemporaryDirectory(prefix="pddnet-bench-tls-")
    if not args.no_tls:
        from ..transport.testing import make_test_certs

        if make_test_certs(tmp.name) is None:
            print("no openssl command: skipping the TLS rows", file=sys.stderr)
        else:
            args.tls_dir = tmp.name
    errors: dict[str, str] = {}
    args.missing = {}
    if links and not args.no_baselines:
        why = missing_iperf3(args.install_peers, errors)
        if why:
            args.missing["iperf3"] = why
            print(f"iperf3 missing: {why}; the iperf3 comparison is skipped", file=sys.stderr)
    tls_steps = len(links) if args.tls_dir else 0
    per_round = 1 if args.no_baselines or args.missing else 2
    steps = args.repeat + (per_round * (args.rounds + args.warmup) + 1) * len(links) + tls_steps
    steps += 2 if links else 0
    rows: list[dict[str, Any]] = []
    prio = None
    paired: dict[str, dict[str, Any]] = {}
    with tmp, Progress(steps, "bench wan") as bar:
        if not args.no_loopback:
            rows += loopback(args, bar)
        prios: list[dict[str, Any]] = []
        for link in links:
            is_quick_link = link == K_QUICK_LINK
            r, p, paired[_link_name(link)] = emulated(
                args, link, bar, priority=is_quick_link or args.priority_all, errors=errors
            )
            rows += r
            if p:
                prios.append(p)
                # the summary's RTT units need an RTT: a 0 ms link's only if nothing else
                if is_quick_link or prio is None or (prio["rtt_s"] == 0 and p["rtt_s"] > 0):
                    prio = p
    # pacing and chunk_size: in the JSON only
    shown = [
        {k: v for k, v in r.items() if k not in ("pacing", "chunk_size", "cpu_sys_share")}
        for r in rows
    ]
    print_table(shown, title=f"WAN goodput, N={args.streams}, cc={args.cc}")
    summary: dict[str, Any] = {"streams": args.streams, "congestion": args.cc}
    if args.notsent_lowat is not None:
        summary["notsent_lowat"] = args.notsent_lowat
    if args.missing:
        summary["missing_peers"] = dict(args.missing)
    lb = {r["sender"].split()[0]: r["goodput_gbps"] for r in rows if r["link"] == "loopback"}
    if lb:
        summary["loopback_ratio_vs_raw_tcp"] = lb["pddnet"] / lb["plain"]
    quick = _link_name(K_QUICK_LINK)
    q = {r["sender"].split()[0]: r["goodput_gbps"] for r in rows if r["link"] == quick}
    if "pddnet" in q:
        summary["link_utilization"] = q["pddnet"] / (K_QUICK_LINK["rate_mbit"] / 1e3)
        if "plain" in q:
            summary["ratio_vs_single_tcp"] = q["pddnet"] / q["plain"]
    # The paired rounds of the quick link (or the only link run) carry the ratio.
    head = paired.get(quick) or (next(iter(paired.values())) if len(paired) == 1 else None)
    if head is not None:
        summary.update({k: v for k, v in head.items() if k != "log" and not k.endswith("_rounds")})
        for k in ("ratio_vs_iperf3_rounds", "cpu_per_gb_ratio_vs_iperf3_rounds"):
            summary[k] = head[k]
    summary.update(_tls_summary(rows, "loopback", "loopback_"))
    summary.update(_tls_summary(rows, quick, ""))
    if prio:
        rtt = prio["rtt_s"]
        summary["small_samples"] = len(prio["priority"]["small_s"])
        if rtt > 0:
            summary["small_p99_rtts"] = prio["priority"]["p99"] / rtt
            summary["small_max_rtts"] = prio["priority"]["max"] / rtt
            if "priority_warm" in prio:  # the same sender's second bulk transfer
                summary["small_p99_rtts_warm"] = prio["priority_warm"]["p99"] / rtt
            if "fifo" in prio:
                summary["small_p99_rtts_fifo"] = prio["fifo"]["p99"] / rtt
        print_table(
            [
                {
                    "policy": p,
                    **{k: prio[p][k] * 1e3 for k in ("p50", "p99", "max")},
                    "bulk_gbps": prio[p]["bulk_goodput_gbps"],
                }
                for p in ("priority", "priority_warm", "fifo")
                if p in prio
            ],
            title=f"\n256 KiB completion (ms) during bulk on {prio['link']}",
        )
    print("\nsummary:", json.dumps(summary, indent=1))
    for p in prios:
        if p is not prio:
            rtts = f" ({p['priority']['p99'] / p['rtt_s']:.1f} RTT)" if p["rtt_s"] > 0 else ""
            print(
                f"256 KiB during bulk on {p['link']}: p50 {p['priority']['p50'] * 1e3:.0f} ms, "
                f"p99 {p['priority']['p99'] * 1e3:.0f} ms{rtts}, "
                f"bulk {p['priority']['bulk_goodput_gbps']:.3f} Gbit/s"
            )
    write_report(
        args.json, summary, rows=rows, priority=prio, priorities=prios, rounds=paired, errors=errors
    )
    if getattr(args, "png", None):
        _plot(args.png, rows, prio)
    return 0
