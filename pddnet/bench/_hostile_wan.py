"""Hostile peers against a WAN receiver in its own process (issue 19, attacks 2-4).

The server, ``python -m pddnet.bench._hostile_wan [--buffer-bytes N]``, runs a
:class:`~pddnet.transport.wan.WanReceiver` as ``MainEndpoint`` builds it (the
shared secret, default :class:`~pddnet.transport.wan.WanLimits`) beside a
heartbeat task that sleeps 5 ms in a loop: how late it wakes is how long the
loop ran nothing else (its *stall*). On a machine with more runnable
processes than cores much of that is the OS running others; the part the
loop's own thread spent running (its CPU time over the late interval, at
most the lateness) is the *CPU stall*: the attacks' ``loop_stall_under_100ms``
check uses it, and both are reported. It reads JSON commands on stdin, one a
line, and answers each on stdout with one line carrying the command's ``id``:

* ``{"op": "grant", "size": N, "timeout": T}``: a grant of ``N`` bytes;
  answers ``tid`` and ``address``. A task notes when it ends.
* ``{"op": "wait", "tid": ...}``: once that grant ended: ``ok``, ``error``
  (the exception's type name), ``late_s`` (end minus deadline), ``sha256``.
* ``{"op": "stats"}``: the receiver's statistics, ``max_stall_ms`` and
  ``max_stall_cpu_ms`` (since the previous ``stats``), ``fds`` (open
  descriptors), ``rss_kib`` (peak RSS) and ``load`` (the 1-minute load average).

EOF ends it. The attacks run in the caller's process over loopback, strangers
from other ``127.0.0.x`` addresses, while an honest :class:`WanSender` moves
a transfer through the same server and checks every byte:

* :func:`handshake_squat` (attack 2): strangers that connect and never
  authenticate, holding every handshake slot and reopening when shed;
* :func:`tiny_chunks` (attack 3): an authenticated peer sending valid 1-byte
  chunks (reading its ACKs);
* :func:`unread_acks` (attack 4): an authenticated peer sending small chunks
  and their duplicates, never reading its ACKs, while grants with 1, 2 and
  3 s deadlines wait for data that never comes.

Each returns an :class:`~._hostile.AttackResult`; the tests
(tests/test_hostile_wan.py) and ``pddnet bench hostile`` run the same ones.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import mmap
import os
import resource
import socket
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio

import pddnet

from .._errors import PddnetError
from ..kv import ByteRanges
from ..transport._auth import authenticate
from ..transport._base import Grant
from ..transport.wan import WanReceiver, WanSender
from ..wire import ChecksumAlgo, ChunkHeader, checksum
from ..wire._auth import AuthRole
from ._hostile import K_MAX_LOOP_STALL_MS, AttackResult

__all__ = [
    "SECRET",
    "Server",
    "authenticated",
    "discard",
    "encode_chunk",
    "handshake_squat",
    "honest_transfer",
    "run_attacks",
    "tiny_chunks",
    "unread_acks",
]

SECRET = b"hostile-wan-secret-0123456789abcd"
K_BEAT_S = 0.005
K_HONEST_SIZE = 4 << 20
K_FD_SLACK = 2  # descriptors the server may keep above its baseline after an attack
K_DEADLINE_MARGIN_S = 0.25  # a grant's timeout ends it at most this late (plus the OS's delay)


# -- the server (child process) ----------------------------------------------------


async def _serve(buffer_bytes: int | None) -> None:
    stall = [0.0, 0.0]  # the longest stall since the last "stats": wall clock, CPU
    grants: dict[int, tuple[mmap.mmap, float | None, trio.Event, dict[str, Any]]] = {}
    out = trio.wrap_file(sys.stdout)
    lock = trio.Lock()

    async def reply(msg: dict[str, Any]) -> None:
        async with lock:
            await out.write(json.dumps(msg) + "\n")
            await out.flush()

    async def heartbeat() -> None:
        while True:
            t, cpu = trio.current_time(), time.thread_time()
            await trio.sleep(K_BEAT_S)
            late = trio.current_time() - t - K_BEAT_S
            # of that, what the loop's thread ran (the rest: the OS ran other processes)
            busy = min(late, time.thread_time() - cpu)
            stall[0], stall[1] = max(stall[0], late), max(stall[1], busy)

    async def watch(rx: WanReceiver, tid: int) -> None:
        buf, deadline, done, result = grants[tid]
        start = trio.current_time()
        try:
            await rx.wait_transfer(tid)
            result.update(ok=True, error=None)
        except PddnetError as exc:
            result.update(ok=False, error=type(exc).__name__, message=str(exc))
        end = trio.current_time()
        sha = await trio.to_thread.run_sync(lambda: hashlib.sha256(buf).hexdigest())
        result.update(late_s=None if deadline is None else end - deadline, age_s=end - start)
        result.update(sha256=sha)
        done.set()

    async def handle(rx: WanReceiver, nursery: trio.Nursery, cmd: dict[str, Any]) -> None:
        op, msg = cmd["op"], {"id": cmd["id"]}
        if op == "grant":
            size, timeout = int(cmd["size"]), cmd.get("timeout")
            # anonymous memory: zero pages mapped as written (a bytearray's memset of
            # 64 MiB held the GIL, and so the loop, for hundreds of ms under load)
            buf = mmap.mmap(-1, size)
            g = rx.grant([buf], ByteRanges.build([0], [0], [size], [0]), timeout=timeout)
            deadline = None if timeout is None else trio.current_time() + timeout
            grants[g.transfer_id] = (buf, deadline, trio.Event(), {})
            nursery.start_soon(watch, rx, g.transfer_id)
            msg.update(tid=g.transfer_id, address=g.address, total=g.total)
        elif op == "wait":
            _, _, done, result = grants[int(cmd["tid"])]
            await done.wait()
            msg.update(result)
        elif op == "stats":
            msg.update(asdict(rx.statistics()))
            msg.update(max_stall_ms=stall[0] * 1e3, max_stall_cpu_ms=stall[1] * 1e3)
            msg.update(fds=len(os.listdir("/proc/self/fd")), load=os.getloadavg()[0])
            msg.update(rss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
            stall[:] = [0.0, 0.0]
        await reply(msg)

    rx_cm = (
        WanReceiver(secret=SECRET)
        if buffer_bytes is None
        else WanReceiver(secret=SECRET, buffer_bytes=buffer_bytes)
    )
    async with rx_cm as rx, trio.open_nursery() as nursery:
        nursery.start_soon(heartbeat)
        await reply({"id": 0, "address": rx.address})
        stdin = trio.wrap_file(sys.stdin)
        while line := await stdin.readline():
            nursery.start_soon(handle, rx, nursery, json.loads(line))
        nursery.cancel_scope.cancel()


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffer-bytes", type=int, default=None)
    trio.run(_serve, parser.parse_args().buffer_bytes)


class Server:
    """A client of the server process (see the module doc). Use :meth:`start`."""

    def __init__(self, proc: trio.Process, stderr: Any) -> None:
        self.proc = proc
        self._stderr = stderr
        self._next = 1
        self._waiting: dict[int, tuple[trio.Event, dict[str, Any]]] = {}
        self._send_lock = trio.Lock()
        self._stderr_text: str | None = None
        self.address = ""

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, *, buffer_bytes: int | None = None) -> AsyncIterator[Server]:
        """Start a server process; yields its client; kills it on exit.

        Args:
            buffer_bytes: the receiver's ``buffer_bytes`` (None: its default).
        """
        argv = [sys.executable, "-m", "pddnet.bench._hostile_wan"]
        if buffer_bytes is not None:
            argv += ["--buffer-bytes", str(buffer_bytes)]
        root = str(Path(pddnet.__file__).resolve().parents[1])  # this pddnet, not another
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        }
        with tempfile.TemporaryFile("w+") as err:
            proc = await trio.lowlevel.open_process(
                argv,
                stdin=-1,
                stdout=-1,
                stderr=err,
                env=env,  # -1: subprocess.PIPE
            )
            srv = cls(proc, err)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(srv._read_replies)
                    hello = await srv._wait(0, 30.0)
                    srv.address = hello["address"]
                    yield srv
                    nursery.cancel_scope.cancel()
            finally:
                with contextlib.suppress(OSError):
                    proc.kill()
                with trio.move_on_after(10), contextlib.suppress(OSError):
                    await proc.wait()
                srv._stderr_text = srv.stderr_tail(1 << 20)  # kept once the file is gone

    def stderr_tail(self, n: int = 3000) -> str:
        """The last ``n`` characters the server wrote to stderr (its log)."""
        if self._stderr_text is None:
            self._stderr.seek(0)
            return str(self._stderr.read())[-n:]
        return self._stderr_text[-n:]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    async def _read_replies(self) -> None:
        assert self.proc.stdout is not None
        buf = b""
        while chunk := await self.proc.stdout.receive_some():
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                msg = json.loads(line)
                ev, box = self._waiting.setdefault(msg["id"], (trio.Event(), {}))
                box.update(msg)
                ev.set()

    async def _wait(self, rid: int, timeout: float) -> dict[str, Any]:
        ev, box = self._waiting.setdefault(rid, (trio.Event(), {}))
        with trio.move_on_after(timeout):
            await ev.wait()
            del self._waiting[rid]
            return box
        raise TimeoutError(f"no answer from the server in {timeout:g} s: {self.stderr_tail()}")

    async def call(self, op: str, *, wait_s: float = 30.0, **args: Any) -> dict[str, Any]:
        """Send one command and wait for its answer (see the module doc).

        Raises:
            TimeoutError: no answer within ``wait_s`` (stderr's tail in the message).
        """
        assert self.proc.stdin is not None
        rid, self._next = self._next, self._next + 1
        self._waiting[rid] = (trio.Event(), {})
        async with self._send_lock:
            line = json.dumps({"id": rid, "op": op, **args}) + "\n"
            await self.proc.stdin.send_all(line.encode())
        return await self._wait(rid, wait_s)

    async def grant(self, size: int, timeout: float) -> Grant:
        g = await self.call("grant", size=size, timeout=timeout)
        return Grant(g["tid"], g["total"], (), g["address"])

    async def stats(self) -> dict[str, Any]:
        """Statistics, the longest stall since the last call, descriptors."""
        return await self.call("stats")

    async def wait_fds(self, baseline: int, timeout: float = 5.0) -> int:
        """Poll until the server holds at most ``baseline + K_FD_SLACK`` descriptors."""
        fds = baseline
        with trio.move_on_after(timeout):
            while (fds := (await self.stats())["fds"]) > baseline + K_FD_SLACK:
                await trio.sleep(0.1)
        return fds


# -- the honest peer ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Honest:
    """An honest transfer's outcome: bit-exact or not, connect and total seconds."""

    ok: bool
    connect_s: float | None
    total_s: float
    error: str | None = None


async def honest_transfer(srv: Server, size: int = K_HONEST_SIZE, timeout: float = 10.0) -> Honest:
    """Move ``size`` random bytes from a new :class:`WanSender` into ``srv`` and check them."""
    data = os.urandom(size)
    ranges = ByteRanges.build([0], [0], [size], [0])
    grant = await srv.grant(size, timeout)
    t0 = trio.current_time()
    connect_s: float | None = None
    error: str | None = None
    try:
        async with WanSender(srv.address, secret=SECRET, streams=2) as tx:
            with trio.move_on_after(timeout):
                await tx.wait_connected(1)
                connect_s = trio.current_time() - t0
            await tx.send(grant, [data], ranges, timeout=timeout)
    except* PddnetError as group:  # raised in the sender's nursery: in a group
        error = type(group.exceptions[0]).__name__
    if error is not None:
        return Honest(False, connect_s, trio.current_time() - t0, error)
    end = await srv.call("wait", tid=grant.transfer_id, wait_s=timeout)
    ok = bool(end["ok"]) and end["sha256"] == hashlib.sha256(data).hexdigest()
    return Honest(ok, connect_s, trio.current_time() - t0, end.get("error"))


# -- attack 2: strangers holding the handshake slots ----------------------------------


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


async def handshake_squat(
    srv: Server,
    *,
    strangers: int = 64,
    rate: float = 13.0,
    duration: float = 3.0,
    honest_after: float = 0.5,
    reopen_delay: float = 0.05,
) -> AttackResult:
    """``strangers`` addresses each hold a connection that never authenticates.

    Each reopens ``reopen_delay`` after the server closes it, so every handshake
    slot (64 by default) stays taken, and ``rate`` more connections a second
    come from the same addresses, each held until closed (issue 19: 256 opens
    at about 13/s). After ``honest_after`` seconds an honest sender connects
    and transfers; it must connect within 1 s.
    """
    base = await srv.stats()
    opens = [0]
    addr = _host_port(srv.address)

    def source(i: int) -> str:
        return f"127.0.{(1 + i) // 254}.{1 + (1 + i) % 254}"  # never 127.0.0.1

    async def hold(src: str) -> None:
        s = trio.socket.socket()
        try:
            await s.bind((src, 0))
            await s.connect(addr)
            opens[0] += 1
            with contextlib.suppress(OSError):
                while await s.recv(1 << 10):  # its CHALLENGE, then the close
                    pass
        except OSError:
            pass
        finally:
            s.close()

    async def stranger(i: int) -> None:
        while True:
            await hold(source(i))
            await trio.sleep(reopen_delay)

    async def opener(nursery: trio.Nursery) -> None:
        i = 0
        while True:
            await trio.sleep(1 / rate)
            nursery.start_soon(hold, source(i % strangers))
            i += 1

    async with trio.open_nursery() as nursery:
        for i in range(strangers):
            nursery.start_soon(stranger, i)
        nursery.start_soon(opener, nursery)
        await trio.sleep(honest_after)
        slots_full = await srv.stats()
        honest = await honest_transfer(srv)
        await trio.sleep(max(0.0, duration - honest_after - honest.total_s))
        nursery.cancel_scope.cancel()
    after = await srv.stats()
    fds = await srv.wait_fds(base["fds"])
    connect_s = honest.connect_s
    return AttackResult(
        attack="wan_handshake_squat",
        max_loop_stall_ms=after["max_stall_ms"],
        honest_ok=int(honest.ok),
        honest_failed=int(not honest.ok),
        checks={
            "server_up": srv.alive,
            "honest_connected_within_1s": connect_s is not None and connect_s < 1.0,
            "honest_bit_exact": honest.ok,
            "loop_stall_under_100ms": after["max_stall_cpu_ms"] < K_MAX_LOOP_STALL_MS,
            "fds_back_to_baseline": fds <= base["fds"] + K_FD_SLACK,
        },
        figures={
            "strangers": strangers,
            "rate": rate,
            "opens": opens[0],
            "opens_per_s": opens[0] / duration,
            "honest_connect_s": connect_s,
            "honest_total_s": honest.total_s,
            "honest_error": honest.error,
            "handshakes_shed": after.get("handshakes_shed", 0) - base.get("handshakes_shed", 0),
            "handshake_timeouts": after.get("handshake_timeouts", 0)
            - base.get("handshake_timeouts", 0),
            "limit_rejections": after["limit_rejections"] - base["limit_rejections"],
            "fds_when_slots_full": slots_full["fds"],
            "fds": [base["fds"], fds],
            **_stall_figures(after),
        },
    )


# -- authenticated floods (attacks 3 and 4) ---------------------------------------------


async def authenticated(address: str, rcvbuf: int | None = None) -> socket.socket:
    """A blocking data connection to ``address`` that passed the challenge-response."""
    sock = socket.socket()
    if rcvbuf is not None:  # before connect, so the window it advertises is that small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)  # a blocking connect would hold this loop
    sock.connect_ex(_host_port(address))
    await trio.lowlevel.wait_writable(sock)
    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        sock.close()
        raise OSError(err, os.strerror(err))
    await authenticate(sock, SECRET, AuthRole.INITIATOR, channel="wan")
    sock.setblocking(True)
    return sock


def encode_chunk(tid: int, offset: int, payload: bytes) -> bytes:
    """A chunk frame (header and payload, CRC32C) as a sender writes it."""
    crc = checksum(ChecksumAlgo.CRC32C, payload)
    return ChunkHeader(tid, offset, len(payload), crc).encode() + payload


def discard(sock: socket.socket) -> None:
    """Read and drop what the receiver sends (its ACKs) until the socket closes."""
    with contextlib.suppress(OSError):
        while sock.recv(1 << 16):
            pass


@dataclass(slots=True)
class _Flood:
    """An authenticated peer's chunk flood, run in a thread with blocking sends."""

    tid: int
    size: int
    chunk: int  # payload bytes per chunk
    dups: int  # times each chunk is sent again right after it
    read_acks: bool
    batch_chunks: int = 256
    offset: int = 0
    chunks_sent: int = 0
    last_sent: float = 0.0  # time.monotonic() of the last batch that went out
    connections: int = 0
    drops: int = 0  # connections that broke under the flood

    def batch(self) -> bytes:
        parts = []
        for _ in range(self.batch_chunks):
            if self.offset >= self.size:
                break
            k = min(self.chunk, self.size - self.offset)
            one = encode_chunk(self.tid, self.offset, os.urandom(k))
            parts.append(one * (1 + self.dups))
            self.offset += k
        return b"".join(parts)

    def blast(self, sock: socket.socket, until: float) -> None:
        """Send batches until ``until`` or the end of the grant; counts a drop."""
        reader = threading.Thread(target=discard, args=(sock,)) if self.read_acks else None
        if reader is not None:
            reader.start()
        try:
            while time.monotonic() < until and (data := self.batch()):
                sock.sendall(data)
                self.chunks_sent += len(data) // (self.chunk + 40)
                self.last_sent = time.monotonic()
            if self.offset >= self.size:  # nothing left to send: hold the connection
                while time.monotonic() < until:
                    time.sleep(0.05)
        except TimeoutError:  # blocked to the end: not dropped
            pass
        except OSError:
            self.drops += 1
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # ends the reader
            if reader is not None:
                reader.join()
            sock.close()

    async def run(self, address: str, duration: float, rcvbuf: int | None = None) -> None:
        """Flood for ``duration`` seconds, reconnecting whenever the server drops us."""
        until = time.monotonic() + duration
        while time.monotonic() < until:
            try:
                sock = await authenticated(address, rcvbuf)
            except (OSError, PddnetError):
                await trio.sleep(0.05)
                continue
            self.connections += 1
            self.last_sent = time.monotonic()
            sock.settimeout(max(0.01, until - time.monotonic()) + 1.0)
            await trio.to_thread.run_sync(self.blast, sock, until)


def _stall_figures(stats: dict[str, Any]) -> dict[str, float]:
    return {
        "max_loop_stall_cpu_ms": stats["max_stall_cpu_ms"],
        "max_loop_stall_wall_ms": stats["max_stall_ms"],
        "load_average": stats["load"],
        "server_peak_rss_kib": stats["rss_kib"],  # grant buffers included
    }


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> int:
    return int(after.get(key, 0) - before.get(key, 0))


async def tiny_chunks(srv: Server, *, size: int = 1 << 20, duration: float = 2.0) -> AttackResult:
    """An authenticated peer sends a ``size``-byte grant as valid 1-byte chunks.

    It reads its ACKs and reconnects when dropped. The grant must fail with a
    ``RemoteProtocolError`` long before its bytes are all sent.
    """
    grant = await srv.grant(size, 60.0)
    base = await srv.stats()
    flood = _Flood(grant.transfer_id, size, chunk=1, dups=0, read_acks=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(flood.run, srv.address, duration)
        await trio.sleep(0.2)
        honest = await honest_transfer(srv)
    attacked: dict[str, Any] = {}
    with contextlib.suppress(TimeoutError):  # still running: the old receiver took it all
        attacked = await srv.call("wait", tid=grant.transfer_id, wait_s=1.0)
    after = await srv.stats()
    fds = await srv.wait_fds(base["fds"])
    verified = _delta(base, after, "bytes_verified") - (K_HONEST_SIZE if honest.ok else 0)
    return AttackResult(
        attack="wan_tiny_chunks",
        max_loop_stall_ms=after["max_stall_ms"],
        honest_ok=int(honest.ok),
        honest_failed=int(not honest.ok),
        checks={
            "server_up": srv.alive,
            "flood_failed_its_grant": attacked.get("error") == "RemoteProtocolError",
            "honest_bit_exact": honest.ok,
            "loop_stall_under_100ms": after["max_stall_cpu_ms"] < K_MAX_LOOP_STALL_MS,
            "fds_back_to_baseline": fds <= base["fds"] + K_FD_SLACK,
        },
        figures={
            "grant_bytes": size,
            "chunks_sent": flood.chunks_sent,
            "attacked_bytes_verified": verified,
            "attacked_error": attacked.get("error"),
            "attacked_ended_s": attacked.get("age_s"),
            "connections": flood.connections,
            "drops": flood.drops,
            "chunk_floods": _delta(base, after, "chunk_floods"),
            "duplicate_floods": _delta(base, after, "duplicate_floods"),
            "honest_total_s": honest.total_s,
            "fds": [base["fds"], fds],
            **_stall_figures(after),
        },
    )


async def unread_acks(
    srv: Server,
    *,
    size: int = 64 << 20,
    chunk: int = 1 << 10,
    duration: float = 8.0,
    deadlines: tuple[float, ...] = (1.0, 2.0, 3.0),
    blocked_within: float = 4.0,
) -> AttackResult:
    """An authenticated peer sends small chunks, each twice more, and never reads its ACKs.

    Its receive buffer is as small as the kernel allows, so the ACKs pile up
    in the server's send buffer until the server, blocked on them, stops
    reading. From then (or after ``blocked_within`` seconds at most) grants
    with ``deadlines`` wait for data that never comes: each must end in
    ``TransferTimeout`` within ``K_DEADLINE_MARGIN_S`` of its deadline, plus
    the loop's longest wall-clock stall (on a loaded machine the OS wakes
    every timer of the process late; the CPU stall is checked apart). The
    flooding connection must be dropped; the peer reconnects until
    ``duration`` has passed.
    """
    grant = await srv.grant(size, 60.0)
    base = await srv.stats()
    flood = _Flood(grant.transfer_id, size, chunk=chunk, dups=2, read_acks=False, batch_chunks=32)
    waits: dict[float, dict[str, Any]] = {}

    async def expire(timeout: float) -> None:
        g = await srv.grant(1 << 10, timeout)
        with contextlib.suppress(TimeoutError):  # never ended: left out of ``waits``
            waits[timeout] = await srv.call("wait", tid=g.transfer_id, wait_s=timeout + 2.0)

    t0 = time.monotonic()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(flood.run, srv.address, duration, 4096)
        with trio.move_on_after(blocked_within):
            while not flood.connections or time.monotonic() - flood.last_sent < 0.5:
                await trio.sleep(0.05)
        blocked_s = time.monotonic() - t0
        for d in deadlines:
            nursery.start_soon(expire, d)
        await trio.sleep(0.2)
        honest = await honest_transfer(srv)
    after = await srv.stats()
    fds = await srv.wait_fds(base["fds"])
    late = {d: waits[d]["late_s"] for d in deadlines if d in waits}
    # as punctual as any timer of that loop: a loaded machine wakes every one late
    margin = K_DEADLINE_MARGIN_S + after["max_stall_ms"] / 1e3
    on_time = all(
        d in waits and waits[d]["error"] == "TransferTimeout" and 0 <= waits[d]["late_s"] < margin
        for d in deadlines
    )
    return AttackResult(
        attack="wan_unread_acks",
        max_loop_stall_ms=after["max_stall_ms"],
        honest_ok=int(honest.ok),
        honest_failed=int(not honest.ok),
        checks={
            "server_up": srv.alive,
            "non_reader_dropped": flood.drops >= 1,
            "deadlines_on_time": on_time,
            "honest_bit_exact": honest.ok,
            "loop_stall_under_100ms": after["max_stall_cpu_ms"] < K_MAX_LOOP_STALL_MS,
            "fds_back_to_baseline": fds <= base["fds"] + K_FD_SLACK,
        },
        figures={
            "chunk_bytes": chunk,
            "chunks_sent": flood.chunks_sent,
            "connections": flood.connections,
            "drops": flood.drops,
            "send_timeouts": _delta(base, after, "send_timeouts"),
            "chunk_floods": _delta(base, after, "chunk_floods"),
            "duplicate_floods": _delta(base, after, "duplicate_floods"),
            "flood_blocked_after_s": blocked_s,
            "deadline_late_s": late,
            "deadline_margin_s": margin,
            "deadline_errors": {d: w["error"] for d, w in waits.items()},
            "honest_total_s": honest.total_s,
            "fds": [base["fds"], fds],
            **_stall_figures(after),
        },
    )


# -- pddnet bench hostile --------------------------------------------------------------


async def run_attacks(quick: bool = True) -> list[AttackResult]:
    """Every attack above against a fresh server each, at its defaults (``quick``: shorter)."""
    plan: list[tuple[Callable[..., Awaitable[AttackResult]], dict[str, Any]]] = [
        (handshake_squat, {"duration": 2.0} if quick else {}),
        (tiny_chunks, {"duration": 1.5} if quick else {}),
        (unread_acks, {"duration": 4.0} if quick else {}),
    ]
    results = []
    for attack, kwargs in plan:
        async with Server.start() as srv:
            results.append(await attack(srv, **kwargs))
    return results


if __name__ == "__main__":
    _main()
