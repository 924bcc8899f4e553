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
import sys
import threading
import time
from typing import Any

import numpy as np

K_GRANT_PORT_OFFSET = 1  # the pdd receiver's grant service listens on PORT + 1
K_SMALL = 256 << 10
K_CPU_QUERY = (1 << 64) - 1


def raw_rx_cpu(host: str, port: int) -> float:
    """CPU seconds the plain-TCP receiver process has used so far."""
    with socket.create_connection((host, port)) as s:
        s.sendall(K_CPU_QUERY.to_bytes(8, "little") + bytes(8))
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return float(json.loads(data)["cpu"])


def _cpu() -> float:
    # getrusage has microsecond resolution; os.times() counts 10 ms ticks, too
    # coarse for a 0.1 s loopback run
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _retrans(sock: socket.socket) -> int:
    from ..transport.wan._sockopts import read_tcp_info

    s = read_tcp_info(sock, 0)
    return s.bytes_retrans if s else 0


def _source(nbytes: int) -> np.ndarray:
    block = np.frombuffer(os.urandom(1 << 22), np.uint8)
    reps = -(-nbytes // block.size)
    return np.tile(block, reps)[:nbytes]


# -- plain TCP: N threads of sendall / recv_into -----------------------------------


def raw_rx(port: int, max_bytes: int) -> None:
    """Accept connections forever; each drains into its own pre-touched region, then acks."""
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("0.0.0.0", port))
    lsock.listen(256)
    dst = np.ones(max_bytes, np.uint8)  # touched, like a KV pool
    print("READY", flush=True)

    def serve(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
            head = b""
            while len(head) < 16:  # 8 bytes slot offset + 8 bytes length
                part = conn.recv(16 - len(head))
                if not part:
                    return
                head += part
            off, n = int.from_bytes(head[:8], "little"), int.from_bytes(head[8:16], "little")
            if off == K_CPU_QUERY:
                conn.sendall(json.dumps({"cpu": _cpu()}).encode())
                return
            mv = memoryview(dst.data)[off : off + n]
            got = 0
            while got < n:
                k = conn.recv_into(mv[got:])
                if not k:
                    break
                got += k
            conn.sendall(b"k")

    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def raw_send(host: str, port: int, nbytes: int, streams: int, congestion: str) -> dict[str, Any]:
    """Send ``nbytes`` split over ``streams`` plain TCP connections; time until all acked."""
    src = _source(nbytes)
    share = -(-nbytes // streams)
    socks = []
    for _ in range(streams):
        s = socket.create_connection((host, port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 20)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
        socks.append(s)
    retrans0 = sum(_retrans(s) for s in socks)
    rx_cpu0 = raw_rx_cpu(host, port)
    cpu0, t0 = _cpu(), time.monotonic()

    def one(i: int) -> None:
        lo, hi = i * share, min((i + 1) * share, nbytes)
        s = socks[i]
        s.sendall(lo.to_bytes(8, "little") + (hi - lo).to_bytes(8, "little"))
        s.sendall(memoryview(src.data)[lo:hi])
        s.recv(1)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    retrans = sum(_retrans(s) for s in socks) - retrans0
    for s in socks:
        s.close()
    cpu_tx = _cpu() - cpu0
    return {
        "bytes": nbytes,
        "seconds": seconds,
        "cpu_tx": cpu_tx,
        "cpu_rx": raw_rx_cpu(host, port) - rx_cpu0,
        "retrans": retrans,
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
                            rep: dict[str, Any] = {"cpu": _cpu()}
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
    tls_dir: str | None = None,
) -> dict[str, Any]:
    """Send ``nbytes`` with pddnet (``repeat`` times); optionally ``small`` high-priority
    256 KiB transfers during the bulk one; over mutual TLS with the certificates in
    ``tls_dir`` if given. Returns the measurements."""
    import trio

    from ..kv import ByteRanges
    from ..transport import Grant
    from ..transport.wan import WanSender
    from ..transport.wan._sender import K_DEFAULT_URGENT_PACING as K_URGENT_PACING
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
            tls=tls_configs(tls_dir)[1] if tls_dir else None,
        ) as tx:
            with trio.fail_after(10):
                await tx.wait_connected()
            for _ in range(repeat):
                ((tid, total),) = gc.ask({"op": "grant", "sizes": [nbytes]})["grants"]
                smalls = gc.ask({"op": "grant", "sizes": [K_SMALL] * small})["grants"]
                rx_cpu0 = gc.ask({"op": "cpu"})["cpu"]
                retrans0 = tx.statistics().bytes_retrans
                resent0 = tx.statistics().bytes_resent
                cpu0, t0 = _cpu(), trio.current_time()
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
                cpu_tx = _cpu() - cpu0
                st = tx.statistics()
                out["runs"].append(
                    {
                        "seconds": seconds,
                        "cpu_tx": cpu_tx,
                        "cpu_rx": gc.ask({"op": "cpu"})["cpu"] - rx_cpu0,
                        "retrans": st.bytes_retrans - retrans0,
                        "resent": st.bytes_resent - resent0,
                        "hedged": st.chunks_hedged,
                        "small_s": done,
                        "congestion": st.streams[0].congestion,
                        "chunk_size": st.chunk_size,
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
