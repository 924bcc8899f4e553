"""Hostile peers against a control port (issue 19, attacks 1, 5, 6, 7): reusable drivers.

The server is a :class:`~pddnet.control.ControlNode` named ``md`` in a child
process (:class:`ControlServer`; run as ``python -m
pddnet.bench._hostile_control serve SECRET``), optionally under a low
``RLIMIT_NOFILE``. It prints its address, then answers commands on stdin,
one JSON line each: ``stats`` (the longest loop stall since
the last ``reset``, its counters and the size of every table it holds),
``send PEER N`` (N events to PEER over its ROUTER), ``fill`` (the child opens
``/dev/null`` until it gets ``EMFILE``, taking every descriptor the attack
left, and answers how many it took and the error that stopped it) and
``free`` (it closes them again). A task sleeping 5 ms
records how late it wakes: that is the loop stall (wall clock). Of that, the
part the loop's own thread spent running (its CPU time over the late
interval) is the *CPU stall*; on a machine with more runnable processes than
cores the rest is the OS running others. As in :mod:`._hostile_wan`, the
100 ms check uses the CPU stall, and both are reported.

Each ``attack_*`` coroutine runs one attack against a fresh server, with an
honest node beside the attacker, and returns an
:class:`~pddnet.bench._hostile.AttackResult` whose ``checks`` are issue 19's
requirements for it (survived: all hold); the tests assert on those and on
its ``figures``, and ``pddnet bench hostile`` reports them. Strangers
are real zmq sockets and TCP connections on loopback: a stranger is a peer
without the secret (:func:`raw_dealer` with ``key=None``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

import trio
import zmq

from .._errors import PddnetError
from .._ratelog import LogLimiter
from ..control import ControlNode
from ..control._secret import curve_keys
from ..wire import Ping
from ._hostile import K_MAX_LOOP_STALL_MS, AttackResult

__all__ = [
    "K_SECRET",
    "ControlServer",
    "attack_descriptor_flood",
    "attack_restart",
    "attack_squatter",
    "attack_stranger_identities",
    "curve_cost",
    "raw_dealer",
    "run_attacks",
]

K_SECRET = b"hostile-control-secret-0123456789"
K_PROBE_S = 0.005  # the loop-stall probe's sleep
K_HONEST_TIMEOUT_S = 1.0  # an honest request must be answered within this
K_SHED_S = 5.0  # silent strangers' connections must be closed by then (HANDSHAKE_IVL is 3 s)
K_FLOOD_S = 2.0  # attack 1: the strangers' time to take descriptors (before HANDSHAKE_IVL)
K_RSS_SLACK_KIB = 2048  # "memory flat": the code before CURVE grew 4.3 to 4.8 MiB


def raw_dealer(
    ctx: zmq.Context[Any], address: str, identity: bytes, *, key: bytes | None = None
) -> zmq.Socket[Any]:
    """A bare DEALER to ``address`` claiming ``identity``.

    With ``key=None`` it is a stranger (zmq's NULL mechanism, no secret);
    with the shared ``key`` it passes the CURVE handshake as a node would,
    so a test can send it hand-made frames.
    """
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, identity)
    if key is not None:
        public, secret = curve_keys(key)
        s.setsockopt(zmq.CURVE_SERVERKEY, public)
        s.setsockopt(zmq.CURVE_PUBLICKEY, public)
        s.setsockopt(zmq.CURVE_SECRETKEY, secret)
    s.connect(address)
    return s


# -- the server (child process) ---------------------------------------------------


def _tables(node: ControlNode) -> dict[str, int]:
    """The size of every table the node holds (per-peer state among them)."""
    sizes = {}
    for name, value in vars(node).items():
        if isinstance(value, dict | set | list):
            sizes[name] = len(value)
        elif isinstance(value, LogLimiter):
            sizes[f"{name}.last"] = len(value._last)
            sizes[f"{name}.suppressed"] = len(value.suppressed)
    router = node._router
    if router is not None:
        sizes["router.guard"] = len(router.guard._senders)
    return sizes


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def _fill(filler: list[int]) -> dict[str, Any]:
    """Open ``/dev/null`` until the process has no descriptor left; what stopped it."""
    try:
        while True:
            filler.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        return {"filled": len(filler), "error": errno.errorcode.get(exc.errno or 0, str(exc))}


async def serve(secret: bytes, name: str = "md") -> None:
    """The child: a ControlNode plus the stall probe and the stdin commands."""
    stall = [0.0, 0.0]  # the longest since the last "reset": wall clock, CPU
    filler: list[int] = []  # the descriptors "fill" took

    async def probe() -> None:
        while True:
            t0, cpu = trio.current_time(), time.thread_time()
            await trio.sleep(K_PROBE_S)
            late = trio.current_time() - t0 - K_PROBE_S
            busy = min(late, time.thread_time() - cpu)
            stall[0], stall[1] = max(stall[0], late), max(stall[1], busy)

    async with ControlNode(name, secret=secret) as node, trio.open_nursery() as nursery:
        nursery.start_soon(probe)
        print(json.dumps({"address": node.address}), flush=True)
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buf = b""
        while True:
            chunk = await stdin.receive_some(4096)
            if not chunk:
                nursery.cancel_scope.cancel()
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd = line.decode().split()
                out: dict[str, Any] = {}
                if cmd == ["stats"]:
                    out = {  # (RSS and descriptors: the parent reads them, as this
                        # process may have no descriptor left to open /proc with)
                        "max_stall_ms": stall[0] * 1e3,
                        "max_stall_cpu_ms": stall[1] * 1e3,
                        "statistics": asdict(node.statistics()),
                        "tables": _tables(node),
                    }
                elif cmd == ["reset"]:
                    stall[:] = [0.0, 0.0]
                elif cmd == ["fill"]:
                    out = _fill(filler)
                elif cmd == ["free"]:
                    out = {"freed": len(filler)}
                    while filler:
                        os.close(filler.pop())
                elif len(cmd) == 3 and cmd[0] == "send":
                    sent = 0
                    for _ in range(int(cmd[2])):
                        with contextlib.suppress(PddnetError):
                            await node.send(cmd[1], Ping(b"from-md"), timeout=1.0)
                            sent += 1
                    out = {"sent": sent}
                print(json.dumps(out), flush=True)


class ControlServer:
    """The child process serving ``md``; use as ``async with ControlServer() as srv``.

    Args:
        secret: the shared secret.
        nofile: the child's ``RLIMIT_NOFILE`` (None: inherited).
    """

    def __init__(self, secret: bytes = K_SECRET, *, nofile: int | None = None) -> None:
        self.secret = secret
        self.nofile = nofile
        self.address = ""
        self.proc: subprocess.Popen[str] | None = None
        # a file, not a pipe (a full pipe would block the child); closed in __aexit__
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.stderr = ""  # what the child logged, once it has exited

    async def __aenter__(self) -> ControlServer:
        def limit() -> None:
            if self.nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pddnet.bench._hostile_control", "serve", self.secret.hex()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            preexec_fn=limit,
        )
        with trio.fail_after(30):
            self.address = json.loads(await self._readline())["address"]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        self._stderr.seek(0)
        self.stderr = self._stderr.read()
        self._stderr.close()

    async def _readline(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        line = await trio.to_thread.run_sync(self.proc.stdout.readline)
        if not line:
            raise PddnetError(f"the server exited (rc {self.proc.poll()})")
        return line

    async def command(self, cmd: str, timeout: float = 30.0) -> dict[str, Any]:
        """Send one command line; its JSON answer."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        with trio.fail_after(timeout):
            out = dict(json.loads(await self._readline()))
        if cmd == "stats":
            out["rss_kib"] = _rss_kib(self.proc.pid)
            out["fds"] = len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        return out

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class _Honest:
    """An honest node connected to ``md`` that counts its pings."""

    def __init__(self, node: ControlNode) -> None:
        self.node = node
        self.requests = 0
        self.failed = 0

    async def ping(self) -> bool:
        """One ping to ``md``; whether it was answered within 1 s."""
        self.requests += 1
        try:
            await self.node.ping("md", timeout=K_HONEST_TIMEOUT_S)
        except PddnetError:
            self.failed += 1
            return False
        return True

    async def answered_within(self, bound_s: float) -> float | None:
        """Seconds until a ping is answered (None: not within ``bound_s``)."""
        t0 = trio.current_time()
        while trio.current_time() - t0 < bound_s:
            if await self.ping():
                return trio.current_time() - t0
        return None


@contextlib.asynccontextmanager
async def _honest(server: ControlServer, name: str = "p0") -> AsyncIterator[_Honest]:
    async with ControlNode(name, secret=server.secret) as node:
        await node.connect("md", server.address)
        yield _Honest(node)


def _stalls(stats: dict[str, Any]) -> dict[str, float]:
    return {
        "max_loop_stall_wall_ms": stats["max_stall_ms"],
        "max_loop_stall_cpu_ms": stats["max_stall_cpu_ms"],
    }


def _refusals(stats: dict[str, Any]) -> int:
    """How many connections or frames the server refused, at any stage."""
    return sum(v for k, v in stats["statistics"].items() if k.startswith("rejected_"))


# -- attack 5: many stranger identities ------------------------------------------------


async def attack_stranger_identities(
    strangers: int = 1500, batch: int = 100, bound_s: float = 60.0
) -> AttackResult:
    """1,500 strangers, each its own zmq identity and TCP connection, each sending garbage.

    A warm-up flood of one batch comes first, so the RSS baseline includes
    what zmq and the allocator keep after any flood.
    """
    ctx: zmq.Context[Any] = zmq.Context.instance()

    async def flood(first: int, n: int) -> None:
        for start in range(first, first + n, batch):
            socks = [
                raw_dealer(ctx, server.address, f"stranger-{i}".encode())
                for i in range(start, min(start + batch, first + n))
            ]
            for s in socks:
                with contextlib.suppress(zmq.Again):
                    s.send(os.urandom(64), zmq.NOBLOCK)
            await trio.sleep(0.05)
            for s in socks:
                s.close(0)

    async def settled(fds: int) -> dict[str, Any]:
        """Stats once the strangers' connections are gone and nothing more is refused."""
        last = -1
        with trio.fail_after(bound_s):
            while True:
                st = await server.command("stats")
                if st["fds"] <= fds and _refusals(st) == last:
                    return st
                last = _refusals(st)
                await trio.sleep(0.25)

    async with ControlServer() as server, _honest(server) as honest:
        before_ok = await honest.ping()
        fds = (await server.command("stats"))["fds"]
        await flood(0, batch)
        base = await settled(fds + 2)
        await server.command("reset")
        t0 = trio.current_time()
        await flood(batch, strangers)
        elapsed = trio.current_time() - t0
        end = await settled(fds + 2)
        after_ok = await honest.ping()
        alive = server.alive()
    grown = {
        k: (base["tables"].get(k, 0), v)
        for k, v in end["tables"].items()
        if v > base["tables"].get(k, 0) + 4
    }
    lines = server.stderr.splitlines()  # everything the server logged
    st = end["statistics"]
    refused = _refusals(end) - _refusals(base)
    return AttackResult(
        f"control: {strangers:,} stranger identities",
        max_loop_stall_ms=end["max_stall_ms"],
        honest_ok=honest.requests - honest.failed,
        honest_failed=honest.failed,
        checks={
            "server up": alive,
            "honest node answered before and after": before_ok and after_ok,
            "loop stall < 100 ms": end["max_stall_cpu_ms"] < K_MAX_LOOP_STALL_MS,
            "every stranger refused": refused >= strangers,
            "nothing delivered to a handler": st["delivered"] == 1,  # the honest ping
            "no table grew": not grown,
            "RSS flat (< 2 MiB over baseline)": end["rss_kib"] - base["rss_kib"] < K_RSS_SLACK_KIB,
            "descriptors back to baseline": end["fds"] <= base["fds"] + 2,
            "log lines rate-limited": len(lines) <= 2 * (int(elapsed) + 2),
        },
        figures={
            **_stalls(end),
            "strangers": strangers,
            "flood_s": elapsed,
            "refused": refused,
            "tables_grown": grown,
            "rss_kib": (base["rss_kib"], end["rss_kib"]),
            "fds": (base["fds"], end["fds"]),
            "log_lines": len(lines),
        },
    )


# -- attack 6: a stranger claims a real node's name -----------------------------------


def _drain(sock: zmq.Socket[Any]) -> int:
    n = 0
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return n
        n += 1


async def attack_squatter(pings: int = 3, frames: int = 5) -> AttackResult:
    """A stranger connects first under ``p0``'s name; another after ``p0`` is up.

    ``p0`` then pings ``md`` ``pings`` times, and ``md`` sends ``frames``
    events to ``p0`` over its ROUTER: none may reach a stranger, and p0
    must get its answers and the events.
    """
    ctx: zmq.Context[Any] = zmq.Context.instance()
    async with ControlServer() as server:
        first = raw_dealer(ctx, server.address, b"p0")
        with contextlib.suppress(zmq.Again):
            first.send(b"x" * 40, zmq.NOBLOCK)
        await trio.sleep(0.3)  # the stranger is there first
        try:
            async with _honest(server) as honest:
                node = honest.node
                answered = [await honest.ping() for _ in range(pings)]
                late = raw_dealer(ctx, server.address, b"p0")  # tries to take the route over
                await trio.sleep(0.3)
                delivered0 = node.statistics().delivered
                sent = (await server.command(f"send p0 {frames}"))["sent"]
                with trio.move_on_after(2):
                    while node.statistics().delivered - delivered0 < frames:
                        await trio.sleep(0.02)
                got = node.statistics().delivered - delivered0
                answered.append(await honest.ping())
                await trio.sleep(0.2)
                stolen = _drain(first) + _drain(late)
                late.close(0)
        finally:
            first.close(0)
        st = await server.command("stats")
        alive = server.alive()
    return AttackResult(
        "control: a stranger claims a node's name",
        max_loop_stall_ms=st["max_stall_ms"],
        honest_ok=honest.requests - honest.failed,
        honest_failed=honest.failed,
        checks={
            "server up": alive,
            "loop stall < 100 ms": st["max_stall_cpu_ms"] < K_MAX_LOOP_STALL_MS,
            "the real node is answered": all(answered),
            "nothing delivered to the stranger": stolen == 0,
            "md's frames reach the real node": sent == got == frames,
        },
        figures={
            **_stalls(st),
            "pings_answered": sum(answered[:pings]),
            "pings": pings,
            "md_sent": sent,
            "p0_got": got,
            "frames_to_strangers": stolen,
            "refused": _refusals(st),
        },
    )


# -- attack 7: a node restarts at once under its name -----------------------------------


async def node_main(address: str, secret: bytes, bound_s: float) -> None:
    """A restarted ``p0`` (own process): connect, ping until answered, report, then idle."""
    async with ControlNode("p0", secret=secret) as node:
        t0 = trio.current_time()
        await node.connect("md", address)
        answered: float | None = None
        while trio.current_time() - t0 < bound_s:
            try:
                await node.ping("md", timeout=0.25)
            except PddnetError:
                continue
            answered = trio.current_time() - t0
            break
        print(json.dumps({"answered_s": answered}), flush=True)
        await trio.sleep_forever()


async def attack_restart(tries: int = 8, bound_s: float = 12.0) -> AttackResult:
    """``p0`` (a process) restarts ``tries`` times at once under its name.

    The old instance is killed (``SIGKILL``: the kernel closes its
    connection) on even tries and frozen (``SIGSTOP``: its connection stays
    open and silent, as a hung process's does) on odd ones. Each new
    instance measures how long until ``md`` answers it.
    """
    times: list[float | None] = []
    frozen: list[subprocess.Popen[str]] = []
    async with ControlServer() as server:
        old: subprocess.Popen[str] | None = None
        for k in range(tries + 1):
            proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "pddnet.bench._hostile_control", "node"),
                    *(server.address, server.secret.hex(), str(bound_s)),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            if old is not None:  # the previous instance goes as the new one starts
                if k % 2:
                    old.kill()
                    old.wait()
                else:
                    old.send_signal(signal.SIGSTOP)
                    frozen.append(old)
            assert proc.stdout is not None
            line = await trio.to_thread.run_sync(proc.stdout.readline)
            answered = json.loads(line)["answered_s"] if line else None
            if k:  # the first start is no restart
                times.append(answered)
            old = proc
        st = await server.command("stats")
        alive = server.alive()
        for p in [*frozen, old]:
            if p is not None:
                p.kill()
                p.wait()
                if p.stdout is not None:
                    p.stdout.close()
    ok = [t for t in times if t is not None and t <= 1.0]
    return AttackResult(
        "control: a node restarts at once under its name",
        max_loop_stall_ms=st["max_stall_ms"],
        honest_ok=len(ok),
        honest_failed=len(times) - len(ok),
        checks={
            "server up": alive,
            "loop stall < 100 ms": st["max_stall_cpu_ms"] < K_MAX_LOOP_STALL_MS,
            "every restart answered within 1 s": len(ok) == tries,
        },
        figures={**_stalls(st), "answered_s": times, "within_1s": len(ok), "tries": tries},
    )


# -- attack 1 on the control port: more connections than descriptors --------------------


def _open_tcp(address: str) -> socket.socket:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    s = socket.socket()
    s.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        s.connect((host, int(port)))
    return s


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset, or refused
        return True


async def _hold_tcp(address: str, n: int, socks: list[socket.socket], reopen: bool) -> None:
    """Open ``n`` silent connections; with ``reopen``, one the server closes is opened again."""
    socks.extend(_open_tcp(address) for _ in range(n))
    while reopen:
        await trio.sleep(0.05)
        for i, s in enumerate(socks):
            if _closed(s):
                s.close()
                socks[i] = _open_tcp(address)


async def attack_descriptor_flood(
    nofile: int = 256,
    extra: int = 64,
    dealers: int = 32,
    hold_s: float = 8.0,
    reopen: bool = False,
) -> AttackResult:
    """More connections to the control port than the server has descriptors, held open.

    ``nofile + extra`` raw TCP connections that never speak (with
    ``reopen``, each one the server closes is opened again at once), and
    ``dealers`` zmq DEALERs without the secret (they reconnect whenever
    refused). Once they hold all but 8 of the server's descriptors, or after
    ``K_FLOOD_S`` if zmq's I/O thread has not accepted that many by then (on
    a loaded machine it may not: waiting for the strangers alone left the
    server short of the limit now and then), the server takes whatever is
    left itself (``fill``: it opens descriptors until ``EMFILE``), so it is
    surely out of them, and keeps them while the attack lasts: a descriptor
    anyone else gets is one the server freed by closing a stranger's
    connection. Then the honest node already connected pings it, the server
    must close the strangers' connections within 5 s though they hold them
    open, and a new node that connects meanwhile must be answered within
    ``hold_s``. Then the strangers leave, the server frees its own
    (``free``) and descriptors must return to their baseline.
    """
    ctx: zmq.Context[Any] = zmq.Context.instance()
    n = nofile + extra
    async with ControlServer(nofile=nofile) as server, _honest(server) as honest:
        assert await honest.ping()
        base = await server.command("stats")
        await server.command("reset")
        raw: list[socket.socket] = []
        taken = 0  # the most descriptors the server had before the fill
        squatters = [raw_dealer(ctx, server.address, b"s%d" % i) for i in range(dealers)]
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_hold_tcp, server.address, n, raw, reopen)
                with trio.move_on_after(K_FLOOD_S):
                    while taken < nofile - 8:
                        taken = max(taken, (await server.command("stats"))["fds"])
                        await trio.sleep(0.05)
                fill = await server.command("fill")
                t_full = trio.current_time()
                peak = max(taken, (await server.command("stats"))["fds"])
                own = fill["filled"]  # descriptors the server holds for the fill
                shed_s: list[float] = []

                async def watch_shed() -> None:
                    # when the server first let go of half the descriptors
                    # it does not hold for the fill, while the strangers
                    # still hold their ends open
                    while (await server.command("stats"))["fds"] - own >= (nofile - own) // 2:
                        await trio.sleep(0.1)
                    shed_s.append(trio.current_time() - t_full)

                nursery.start_soon(watch_shed)
                kept_up = [await honest.ping() for _ in range(3)]
                async with _honest(server, "p1") as newcomer:
                    new_s = await newcomer.answered_within(hold_s)
                with trio.move_on_at(t_full + hold_s):
                    while not shed_s:
                        await trio.sleep(0.1)
                nursery.cancel_scope.cancel()
        finally:
            for s in raw:
                s.close()
            for d in squatters:
                d.close(0)
        freed = (await server.command("free"))["freed"]
        with trio.move_on_after(10):
            while (end := await server.command("stats"))["fds"] > base["fds"] + 4:
                await trio.sleep(0.2)
        after_ok = await honest.ping()
        alive = server.alive()
    return AttackResult(
        "control: more connections than descriptors",
        max_loop_stall_ms=end["max_stall_ms"],
        honest_ok=honest.requests - honest.failed,
        honest_failed=honest.failed,
        checks={
            "server up": alive,
            "loop stall < 100 ms": end["max_stall_cpu_ms"] < K_MAX_LOOP_STALL_MS,
            "ran out of descriptors": fill["error"] == "EMFILE" and peak >= nofile - 8,
            "connected node answered throughout": all(kept_up) and after_ok,
            f"a new node answered within {hold_s:g} s": new_s is not None,
            f"strangers' connections closed within {K_SHED_S:g} s": bool(shed_s)
            and shed_s[0] < K_SHED_S,
            "descriptors back to baseline": freed == own and end["fds"] <= base["fds"] + 4,
        },
        figures={
            **_stalls(end),
            "nofile": nofile,
            "reopen": reopen,
            "strangers": n + dealers,
            "fds": (base["fds"], peak, end["fds"]),  # baseline, the most, after
            "fds_before_fill": taken,  # the most before the server took the rest
            "filled": own,  # what the server took itself
            "fill_error": fill["error"],  # what stopped it: EMFILE, out of descriptors
            "connected_pings_answered": sum(kept_up),
            "new_node_answered_s": new_s,
            "strangers_shed_s": shed_s[0] if shed_s else None,
            "refused": _refusals(end),
        },
    )


async def run_attacks(quick: bool = True) -> list[AttackResult]:
    """Every control-plane attack above, one after the other (``quick``: fewer strangers)."""
    return [
        await attack_descriptor_flood(),
        await attack_stranger_identities(500 if quick else 1500),
        await attack_squatter(),
        await attack_restart(4 if quick else 8),
    ]


def curve_cost(curve: bool, connections: int = 200, rounds: int = 5000) -> dict[str, float]:
    """Raw pyzmq ROUTER/DEALER on loopback, with or without CURVE (blocking; no pddnet).

    Handshake = connect to first reply; round trips of 100 B and 4 KiB; one-way
    rates of 100 B and 64 KiB messages. What docs/reliability.md compares.
    """
    ctx: zmq.Context[Any] = zmq.Context()
    key = K_SECRET if curve else None
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    if curve:
        router.setsockopt(zmq.CURVE_SERVER, 1)
        router.setsockopt(zmq.CURVE_SECRETKEY, curve_keys(K_SECRET)[1])
    router.bind("tcp://127.0.0.1:0")
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)

    def echo() -> None:
        router.send_multipart(router.recv_multipart())

    handshakes = []
    for i in range(connections):
        t0 = time.perf_counter()
        d = raw_dealer(ctx, address, b"h%d" % i, key=key)
        d.send(b"h")
        echo()
        d.recv()
        handshakes.append(time.perf_counter() - t0)
        d.close(0)
    d = raw_dealer(ctx, address, b"bench", key=key)
    out = {"handshake_ms_p50": statistics.median(handshakes) * 1e3}
    for size in (100, 4096):
        msg, rtts = b"x" * size, []
        for _ in range(rounds):
            t0 = time.perf_counter()
            d.send(msg)
            echo()
            d.recv()
            rtts.append(time.perf_counter() - t0)
        out[f"rtt_us_p50_{size}B"] = statistics.median(rtts) * 1e6
    for size, n in ((100, 100_000), (65536, 5000)):
        msg = b"x" * size
        t0 = time.perf_counter()
        for i in range(n):
            d.send(msg)
            if i % 1000 == 999:  # drain in batches, below the high-water mark
                for _ in range(1000):
                    router.recv_multipart()
        out[f"oneway_msgs_per_s_{size}B"] = n / (time.perf_counter() - t0)
    d.close(0)
    router.close(0)
    ctx.term()
    return out


def _main(argv: list[str]) -> None:
    if argv[0] == "serve":
        trio.run(serve, bytes.fromhex(argv[1]))
    elif argv[0] == "node":
        trio.run(node_main, argv[1], bytes.fromhex(argv[2]), float(argv[3]))
    elif argv[0] == "curve":
        for curve in (False, True):
            res = {k: round(v, 2) for k, v in curve_cost(curve).items()}
            print("CURVE" if curve else "NULL ", json.dumps(res))
    else:
        raise SystemExit(
            f"usage: {sys.argv[0]} serve SECRET_HEX | node ADDRESS SECRET_HEX BOUND | curve"
        )


if __name__ == "__main__":
    _main(sys.argv[1:])
