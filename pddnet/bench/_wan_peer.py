"""Processes of ``pddnet bench wan``: receivers (servers) and senders (functions).

Receivers run as ``python -m pddnet.bench._wan_peer raw-rx|pdd-rx PORT ...``
(``pdd-rx PORT TLS_DIR`` for a TLS receiver with the certificates of
:func:`pddnet.transport.testing.make_test_certs` in ``TLS_DIR``), print
``READY`` once listening, and serve until killed. Senders are plain functions
that a :class:`pddnet.emu.Host` runs with ``call`` (or the bench runs
directly on loopback); they return a dict of measurements.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import struct
import sys
import threading
import time
from typing import Any

import numpy as np

K_GRANT_PORT_OFFSET = 1  # the pdd receiver's grant service listens on PORT + 1
K_SMALL = 256 << 10
K_CPU_QUERY = (1 << 64) - 1
# the plain-TCP receiver's ack: its SO_RCVBUF when the stream began and when it ended
_ACK = struct.Struct("<QQ")
# tcp_info's tcpi_busy_time, tcpi_rwnd_limited, tcpi_sndbuf_limited (u64 µs) at offset 168
_CHRONO = struct.Struct("<QQQ")


def raw_rx_cpu(host: str, port: int) -> tuple[float, float, float]:
    """CPU seconds the plain-TCP receiver process has used so far, of those in the
    kernel, and seconds it waited for a CPU (:func:`run_delay`)."""
    with socket.create_connection((host, port)) as s:
        s.sendall(K_CPU_QUERY.to_bytes(8, "little") + bytes(8))
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    rep = json.loads(data)
    return float(rep["cpu"]), float(rep["sys"]), float(rep["wait"])


def cpu_times() -> tuple[float, float]:
    """CPU seconds this process (all its threads) has used: the total, and of it
    the time in the kernel."""
    # getrusage has microsecond resolution; os.times() counts 10 ms ticks, too
    # coarse for a 0.1 s loopback run
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_stime


def _cpu_report() -> dict[str, float]:
    """What a receiver answers a CPU query with."""
    cpu, sys_s = cpu_times()
    return {"cpu": cpu, "sys": sys_s, "wait": run_delay()}


def run_delay(pid: int | str = "self") -> float:
    """Seconds the threads of process ``pid`` have waited for a CPU while runnable
    (``/proc/PID/task/*/schedstat``); what is unreadable counts 0."""
    total = 0
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with (
                contextlib.suppress(OSError, ValueError, IndexError),
                open(f"/proc/{pid}/task/{task}/schedstat") as f,
            ):
                total += int(f.read().split()[1])
    return total / 1e9


def _retrans(sock: socket.socket) -> int:
    from ..transport.wan._sockopts import read_tcp_info

    s = read_tcp_info(sock, 0)
    return s.bytes_retrans if s else 0


def tcp_time(sock: Any) -> tuple[float, float, float] | None:
    """Seconds a socket has been busy sending, and of those limited by the peer's
    receive window and by its own send buffer (``TCP_INFO`` chrono counters,
    Linux 4.10+), or None. Time not busy is time the application gave it nothing."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _CHRONO.size + 168)
    except OSError:
        return None
    if len(raw) < _CHRONO.size + 168:
        return None
    busy, rwnd, sndbuf = _CHRONO.unpack_from(raw, 168)
    return busy / 1e6, rwnd / 1e6, sndbuf / 1e6


def _tcp_time_spent(socks: list[Any], before: list[Any]) -> dict[str, float]:
    """Totals of :func:`tcp_time` since ``before`` over the sockets still the same."""
    out = {"streams": 0.0, "busy_s": 0.0, "rwnd_limited_s": 0.0, "sndbuf_limited_s": 0.0}
    for sock, (sock0, t0) in zip(socks, before, strict=True):
        t1 = tcp_time(sock) if sock is not None and sock is sock0 else None
        if t0 is None or t1 is None:
            continue
        out["streams"] += 1
        for key, a, b in zip(("busy_s", "rwnd_limited_s", "sndbuf_limited_s"), t0, t1, strict=True):
            out[key] += b - a
    return out


def _source(nbytes: int) -> np.ndarray:
    block = np.frombuffer(os.urandom(1 << 22), np.uint8)
    reps = -(-nbytes // block.size)
    return np.tile(block, reps)[:nbytes]


# -- plain TCP: N threads of sendall / recv_into -----------------------------------


def raw_rx(port: int, max_bytes: int) -> None:
    """Accept connections forever; each drains into its own pre-touched region, then acks
    with its receive buffer's size at the start and at the end (``_ACK``)."""
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("0.0.0.0", port))
    lsock.listen(256)
    dst = np.ones(max_bytes, np.uint8)  # touched, like a KV pool
    print("READY", flush=True)

    def serve(conn: socket.socket) -> None:
        with conn:
            # A user's plain socket: no SO_RCVBUF, so the kernel autotunes the
            # window up to net.ipv4.tcp_rmem's maximum (setting it turns that off).
            rcvbuf0 = conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            head = b""
            while len(head) < 16:  # 8 bytes slot offset + 8 bytes length
                part = conn.recv(16 - len(head))
                if not part:
                    return
                head += part
            off, n = int.from_bytes(head[:8], "little"), int.from_bytes(head[8:16], "little")
            if off == K_CPU_QUERY:
                conn.sendall(json.dumps(_cpu_report()).encode())
                return
            mv = memoryview(dst.data)[off : off + n]
            got = 0
            while got < n:
                k = conn.recv_into(mv[got:])
                if not k:
                    break
                got += k
            rcvbuf1 = conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
            conn.sendall(_ACK.pack(rcvbuf0, rcvbuf1))

    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def raw_send(host: str, port: int, nbytes: int, streams: int, congestion: str) -> dict[str, Any]:
    """Send ``nbytes`` split over ``streams`` plain TCP connections; time until all acked.

    The sockets are what a user's plain socket gets: only the congestion control
    is chosen (the same one as every other sender's); the buffers are left to the
    kernel's autotuning. The result's ``sndbuf`` / ``rcvbuf`` hold each stream's
    buffer sizes (bytes) at the start and at the end of its transfer.
    """
    src = _source(nbytes)
    share = -(-nbytes // streams)
    socks = []
    for _ in range(streams):
        s = socket.create_connection((host, port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
        socks.append(s)
    sndbuf = [[s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF), 0] for s in socks]
    rcvbuf = [[0, 0] for _ in socks]
    retrans0 = sum(_retrans(s) for s in socks)
    tcp0 = [(s, tcp_time(s)) for s in socks]
    rx_cpu0, rx_sys0, rx_wait0 = raw_rx_cpu(host, port)
    (cpu0, sys0), wait0, t0 = cpu_times(), run_delay(), time.monotonic()

    failed: list[BaseException] = []

    def one(i: int) -> None:
        lo, hi = i * share, min((i + 1) * share, nbytes)
        s = socks[i]
        try:
            s.sendall(lo.to_bytes(8, "little") + (hi - lo).to_bytes(8, "little"))
            s.sendall(memoryview(src.data)[lo:hi])
            sndbuf[i][1] = s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            ack = b""
            while len(ack) < _ACK.size:
                part = s.recv(_ACK.size - len(ack))
                if not part:
                    raise ConnectionError(f"plain-TCP receiver closed stream {i} before its ack")
                ack += part
            rcvbuf[i] = list(_ACK.unpack(ack))
        except BaseException as exc:  # re-raised below, in the caller's thread
            failed.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    if failed:
        raise failed[0]
    retrans = sum(_retrans(s) for s in socks) - retrans0
    tcp = _tcp_time_spent(socks, tcp0)
    for s in socks:
        s.close()
    (cpu1, sys1), wait_tx = cpu_times(), run_delay() - wait0
    rx_cpu1, rx_sys1, rx_wait1 = raw_rx_cpu(host, port)
    return {
        "bytes": nbytes,
        "seconds": seconds,
        "cpu_tx": cpu1 - cpu0,
        "cpu_rx": rx_cpu1 - rx_cpu0,
        "cpu_tx_sys": sys1 - sys0,
        "cpu_rx_sys": rx_sys1 - rx_sys0,
        "cpu_wait": {"sender": wait_tx, "receiver": rx_wait1 - rx_wait0},
        "retrans": retrans,
        "sndbuf": sndbuf,
        "rcvbuf": rcvbuf,
        "tcp_time": tcp,
    }


# -- pddnet ----------------------------------------------------------------------------


def tls_configs(tls_dir: str) -> tuple[Any, Any]:
    """(receiver, sender) :class:`TlsConfig` for mutual TLS with the test certificates
    in ``tls_dir`` (the receiver's name is checked as ``localhost``)."""
    from ..transport.wan import TlsConfig

    def f(name: str) -> str:
        return os.path.join(tls_dir, name)

    rx = TlsConfig(
        cert=f("server.pem"), key=f("server.key"), ca=f("ca.pem"), require_client_cert=True
    )
    tx = TlsConfig(
        cert=f("client.pem"), key=f("client.key"), ca=f("ca.pem"), server_hostname="localhost"
    )
    return rx, tx


def pdd_rx(port: int, max_chunk: int = 16 << 20, tls_dir: str | None = None) -> None:
    """A WanReceiver on PORT (TLS with the certificates in ``tls_dir`` if given) and a
    JSON-lines grant service on PORT + 1."""
    import trio

    from ..kv import ByteRanges
    from ..transport.wan import WanReceiver

    tls = tls_configs(tls_dir)[0] if tls_dir else None

    async def main() -> None:
        async with WanReceiver("0.0.0.0", port, max_chunk=max_chunk, tls=tls) as rx:
            held: dict[int, np.ndarray] = {}

            async def keep(tid: int) -> None:
                with contextlib.suppress(Exception):  # the sender reports failures
                    await rx.wait_transfer(tid)
                held.pop(tid, None)

            async def serve(stream: trio.SocketStream) -> None:
                buf = b""
                async for data in stream:
                    buf += data
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        req = json.loads(line)
                        if req["op"] == "cpu":
                            rep: dict[str, Any] = _cpu_report()
                        else:
                            grants = []
                            for n in req["sizes"]:
                                dst = np.ones(n, np.uint8)
                                g = rx.grant([dst], ByteRanges.build([0], [0], [n], [0]))
                                held[g.transfer_id] = dst
                                nursery.start_soon(keep, g.transfer_id)
                                grants.append([g.transfer_id, g.total])
                            rep = {"grants": grants}
                        await stream.send_all(json.dumps(rep).encode() + b"\n")

            async with trio.open_nursery() as nursery:
                listeners = await trio.open_tcp_listeners(port + K_GRANT_PORT_OFFSET)
                print("READY", flush=True)
                await trio.serve_listeners(serve, listeners)

    trio.run(main)


class _GrantClient:
    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port + K_GRANT_PORT_OFFSET))
        self.file = self.sock.makefile("rb")

    def ask(self, req: dict[str, Any]) -> dict[str, Any]:
        self.sock.sendall(json.dumps(req).encode() + b"\n")
        out: dict[str, Any] = json.loads(self.file.readline())
        return out


def pdd_send(
    host: str,
    port: int,
    nbytes: int,
    streams: int,
    congestion: str,
    *,
    chunk_size: int | None = None,
    policy: str = "priority",
    small: int = 0,
    small_interval: float = 0.1,
    small_delay: float = 0.3,
    repeat: int = 1,
    algo: int = 2,
    pacer: str = "adaptive",
    pacer_options: dict[str, Any] | None = None,
    urgent_pacing: float | None = None,
    notsent_lowat: int | None = None,
    tls_dir: str | None = None,
) -> dict[str, Any]:
    """Send ``nbytes`` with pddnet (``repeat`` times); optionally ``small`` high-priority
    256 KiB transfers during the bulk one; over mutual TLS with the certificates in
    ``tls_dir`` if given; ``notsent_lowat`` None: the sender's default. Returns the
    measurements."""
    import trio

    from ..kv import ByteRanges
    from ..transport import Grant
    from ..transport.wan import WanSender
    from ..transport.wan._sender import K_DEFAULT_NOTSENT_LOWAT as K_NOTSENT_LOWAT
    from ..transport.wan._sender import K_DEFAULT_URGENT_PACING as K_URGENT_PACING
    from ..transport.wan._sockopts import K_TCP_NOTSENT_LOWAT
    from ..wire import ChecksumAlgo

    gc = _GrantClient(host, port)
    src = _source(nbytes)
    ranges = ByteRanges.build([0], [0], [nbytes], [0])
    small_src = _source(K_SMALL)
    small_ranges = ByteRanges.build([0], [0], [K_SMALL], [0])
    out: dict[str, Any] = {"bytes": nbytes, "runs": []}

    async def main() -> None:
        async with WanSender(
            f"{host}:{port}",
            streams=streams,
            congestion=congestion,
            chunk_size=chunk_size,
            policy=policy,
            algo=ChecksumAlgo(algo),
            pacer=pacer,
            pacer_options=pacer_options,
            urgent_pacing=K_URGENT_PACING if urgent_pacing is None else (urgent_pacing or None),
            notsent_lowat=K_NOTSENT_LOWAT if notsent_lowat is None else notsent_lowat,
            tls=tls_configs(tls_dir)[1] if tls_dir else None,
        ) as tx:
            with trio.fail_after(10):
                await tx.wait_connected()
            for _ in range(repeat):
                ((tid, total),) = gc.ask({"op": "grant", "sizes": [nbytes]})["grants"]
                smalls = gc.ask({"op": "grant", "sizes": [K_SMALL] * small})["grants"]
                rx0 = gc.ask({"op": "cpu"})
                retrans0 = tx.statistics().bytes_retrans
                resent0 = tx.statistics().bytes_resent
                # the bulk streams' sockets (a private attribute: diagnostics only)
                tcp0 = [
                    (st.sock, tcp_time(st.sock) if st.sock is not None else None)
                    for st in tx._streams[: tx._nbulk]
                ]
                (cpu0, sys0), wait0, t0 = cpu_times(), run_delay(), trio.current_time()
                done: list[float] = []

                async def one_small(tid_s: int, delay: float, done: list[float] = done) -> None:
                    await trio.sleep(delay)
                    start = trio.current_time()
                    await tx.send(Grant(tid_s, K_SMALL), [small_src], small_ranges, priority=1)
                    done.append(trio.current_time() - start)

                async with trio.open_nursery() as n:
                    for i, (tid_s, _) in enumerate(smalls):
                        n.start_soon(one_small, tid_s, small_delay + i * small_interval)
                    await tx.send(Grant(tid, total), [src], ranges, priority=0)
                    seconds = trio.current_time() - t0
                (cpu1, sys1), wait_tx = cpu_times(), run_delay() - wait0
                rx1 = gc.ask({"op": "cpu"})
                tcp = _tcp_time_spent([st.sock for st in tx._streams[: tx._nbulk]], tcp0)
                st = tx.statistics()
                out["runs"].append(
                    {
                        "seconds": seconds,
                        "cpu_tx": cpu1 - cpu0,
                        "cpu_rx": rx1["cpu"] - rx0["cpu"],
                        "cpu_tx_sys": sys1 - sys0,
                        "cpu_rx_sys": rx1["sys"] - rx0["sys"],
                        "cpu_wait": {"sender": wait_tx, "receiver": rx1["wait"] - rx0["wait"]},
                        "retrans": st.bytes_retrans - retrans0,
                        "resent": st.bytes_resent - resent0,
                        "hedged": st.chunks_hedged,
                        "small_s": done,
                        "tcp_time": tcp,
                        "congestion": st.streams[0].congestion,
                        "chunk_size": st.chunk_size,
                        # as the bulk sockets have it now (diagnostics, as tcp_time)
                        "notsent_lowat": sorted(
                            {
                                s.sock.getsockopt(socket.IPPROTO_TCP, K_TCP_NOTSENT_LOWAT)
                                for s in tx._streams[: tx._nbulk]
                                if s.sock is not None
                            }
                        ),
                        "pacing": {
                            "rate_per_stream": st.rate_per_stream,
                            "active_streams": st.active_streams,
                            "trouble": getattr(tx._pacer, "trouble", ""),
                            "trace": list(getattr(tx._pacer, "history", ()))[-400:],
                        },
                    }
                )

    trio.run(main)
    return out


if __name__ == "__main__":
    role, port = sys.argv[1], int(sys.argv[2])
    if role == "raw-rx":
        raw_rx(port, int(sys.argv[3]))
    elif role == "pdd-rx":
        pdd_rx(port, tls_dir=sys.argv[3] if len(sys.argv) > 3 else None)
    else:
        raise SystemExit(f"unknown role {role}")
