"""A dead sender halts only its own session's UCX worker; other senders go on.

With shared-memory transports UCX endpoint error handling cannot be used, so
a sender that dies mid-rendezvous can leave its receive matched and never
completing. Before, the drain deadline then halted the receiver's only UCX
worker and every sender lost the local path. Now each admitted sender gets a
UCX worker of its own (its address travels in the ACCEPT), and the deadline
halts only that one.

Each test: three real processes (receiver, sender A, sender B). B streams
4 MiB transfers (4 pieces, distinct random bytes each) into the receiver the
whole time. A starts a 64 MiB transfer (16 pieces); once its first bytes land
the receiver SIGKILLs A and cancels A's grant. A's transfer must fail typed
(TransportError from its session's halt) within ``drain_timeout`` plus a
margin, nothing may land in A's blocks after its end is reported, and B's
transfers before, during and after A's drain must all complete bit-exact, on
the same receiver, whose path stays open (``path_closed`` false, a fresh grant
works). Without session workers the same run closes the whole path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from pddnet._optional import available

sys.path.insert(0, str(Path(__file__).parent))
from ucx_child import FILES, RUN_MAIN

UCX = available("ucxx._lib.libucxx")

COMMON = (
    """
import json, os, signal, sys, time, trio, numpy as np
from pddnet import PddnetError
from pddnet.kv import ByteRanges
from pddnet.transport import Grant
from pddnet.transport.local import UcxReceiver, UcxSender

D, ROLE, N, DRAIN = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
WORKERS, CMA = sys.argv[5], sys.argv[6]
SECRET = b"pddnet-session-workers-secret-01"
G = 4096  # guard bands around A's region
NEW = 0x55  # the engine's bytes after it reused A's blocks
K = 16  # A's pieces
NB = 4 << 20  # B's transfers: 4 pieces of 1 MiB
KB = 4

def b_bytes(i):
    return np.random.default_rng(1000 + i).integers(0, 256, NB, dtype=np.uint8)

"""
    + FILES
)

RECEIVER = (
    COMMON
    + """
async def main():
    pool = np.zeros(N + 2 * G, np.uint8)
    region = pool[G : G + N]
    ra = ByteRanges.build([0] * K, G + np.arange(K) * (N // K), [N // K] * K, np.arange(K) // 4)
    bpool = np.zeros(NB, np.uint8)
    rb = ByteRanges.build([0] * KB, np.arange(KB) * (NB // KB), [NB // KB] * KB, [0] * KB)
    out = {"b": []}
    t_cancel = None
    a_end = None
    stop_b = trio.Event()
    async with UcxReceiver(
        secret=SECRET, drain_timeout=DRAIN, session_workers=WORKERS == "1", cma=CMA == "1"
    ) as rx:
        put("addr", rx.address)
        pid_a = int(await get("pidA"))
        await get("pidB")
        out["session_workers"] = rx.statistics().session_workers

        async def b_loop():
            i = 0
            while not stop_b.is_set():
                try:
                    g = rx.grant([bpool], rb, timeout=30)
                except PddnetError as exc:  # the receiver's path is closed
                    out["b"].append([i, "grant", type(exc).__name__ + ": " + str(exc), False])
                    break
                put(f"gB{i}", grant_text(g))
                try:
                    with trio.fail_after(20):
                        await rx.wait_transfer(g.transfer_id)
                    ok = bool(np.array_equal(bpool, b_bytes(i)))
                    res = "done"
                except PddnetError as exc:
                    ok, res = False, type(exc).__name__ + ": " + str(exc)
                phase = "before" if t_cancel is None else ("during" if a_end is None else "after")
                out["b"].append([i, phase, res, ok])
                i += 1
            put(f"gB{i}", "stop")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(b_loop)
            while len(out["b"]) < 3:  # B works before anything happens to A
                await trio.sleep(0.01)
            g = rx.grant([pool], ra, timeout=60)
            put("gA", grant_text(g))
            sample = region[::4096]
            with trio.fail_after(20):
                while not sample.any():  # the first bytes of A's payload landed
                    await trio.sleep(0.0003)
            os.kill(pid_a, signal.SIGKILL)
            out["landed_at_kill"] = float(np.count_nonzero(sample) / sample.size)
            t_cancel = time.perf_counter()
            rx.cancel(g.transfer_id)  # the engine gives A's request up
            try:
                with trio.fail_after(DRAIN + 30):
                    await rx.wait_transfer(g.transfer_id)
                out["end"] = "done"
            except PddnetError as exc:
                out["end"], out["error"] = type(exc).__name__, str(exc)
            a_end = time.perf_counter()
            out["end_after_s"] = a_end - t_cancel
            region[:] = NEW  # the engine reuses A's blocks at once
            n_at_end = len(out["b"])
            with trio.fail_after(30):
                while len(out["b"]) < n_at_end + 3:  # B goes on after A's end
                    if out["b"] and out["b"][-1][1] == "grant":
                        break
                    await trio.sleep(0.01)
            # while B still works: once told to stop, B's sender may close its
            # session before the statistics below are read (seen in CI: 0)
            out["senders"] = rx.statistics().senders
            await trio.sleep(0.3)
            stop_b.set()
        out["landed_after_end"] = int(np.count_nonzero(region != NEW))
        out["guards"] = int(np.count_nonzero(pool[:G])) + int(np.count_nonzero(pool[G + N :]))
        st = rx.statistics()
        out["path_closed"], out["sessions_halted"] = st.path_closed, st.sessions_halted
        try:
            rx.grant([bpool], rb, timeout=1)
            out["grant_after"] = "ok"
        except PddnetError as exc:
            out["grant_after"] = type(exc).__name__
    print("RESULT " + json.dumps(out), flush=True)

finish(main)
"""
)

SENDER = (
    COMMON
    + """
async def main():
    async with UcxSender(await get("addr"), secret=SECRET) as tx:
        put("pid" + ROLE, str(os.getpid()))
        if ROLE == "A":
            src = np.full(N, 0xAB, np.uint8)
            ra = ByteRanges.build([0] * K, np.arange(K) * (N // K), [N // K] * K, np.arange(K) // 4)
            t = tx.start(grant_of(await get("gA")), [src], ra, timeout=60)
            await t.wait()
            await trio.sleep(60)  # killed by the receiver
        rb = ByteRanges.build([0] * KB, np.arange(KB) * (NB // KB), [NB // KB] * KB, [0] * KB)
        i = 0
        while True:
            text = await get(f"gB{i}", 60)
            if text == "stop":
                break
            try:
                with trio.fail_after(20):
                    await tx.send(grant_of(text), [b_bytes(i)], rb)
            except PddnetError:
                pass  # the receiver records the outcome
            i += 1

finish(main)
"""
)


def run_trio(tls: str, drain: float, workers: bool = True, cma: bool = True) -> dict[str, object]:
    """Receiver, A and B in three processes; retried if A's payload beat the kill."""
    env = {**os.environ, "UCX_TLS": tls, "UCX_WARN_UNUSED_ENV_VARS": "n"}
    for _attempt in range(3):
        with tempfile.TemporaryDirectory() as d:
            args = [d, "", str(64 << 20), str(drain), "1" if workers else "0", "1" if cma else "0"]
            procs = []
            for code, role in ((RECEIVER, "rx"), (SENDER, "A"), (SENDER, "B")):
                args[1] = role
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", textwrap.dedent(code), *args],
                        stdout=subprocess.PIPE if role == "rx" else subprocess.DEVNULL,
                        stderr=subprocess.PIPE if role == "rx" else subprocess.DEVNULL,
                        text=True,
                        env=env,
                    )
                )
            try:
                out, err = procs[0].communicate(timeout=120)
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        assert procs[0].returncode == 0, err[-3000:]
        line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
        r: dict[str, object] = json.loads(line[len("RESULT ") :])
        if r["landed_at_kill"] == 1.0:
            continue  # all of A's payload beat the kill: try again
        return r
    pytest.fail("all of A's payload arrived before it could be killed, 3 times")


pytestmark = [pytest.mark.ucx, pytest.mark.skipif(not UCX, reason="ucxx is not installed")]


def check_b(r: dict[str, object], *, during: bool) -> None:
    b = r["b"]
    assert isinstance(b, list)
    phases = [x[1] for x in b]
    assert all(x[2] == "done" and x[3] is True for x in b), b  # every B transfer bit-exact
    assert phases.count("before") >= 3 and phases.count("after") >= 3, phases
    if during:
        assert phases.count("during") >= 1, phases


@pytest.mark.parametrize("tls", ["tcp,sm,self", "tcp,posix,sysv,self"])
def test_killed_sender_halts_only_its_session(tls: str) -> None:
    """A is SIGKILLed mid-payload and its grant cancelled; B never notices.

    RLD's ``UCX_TLS=tcp,sm,self`` in every process, the receiver with
    ``cma=False``: with ``cma`` the receiver reads A's memory for the
    rendezvous, and that read after A's death makes UCX abort the receiving
    process (measured; no error handling is possible with shared memory), so
    the receiver leaves it out and the rendezvous fragments travel through the
    shared-memory FIFOs (``posix``/``sysv``). Those A holds back when it dies:
    its matched receives never complete, and at the drain deadline its
    session's worker (only) is halted.
    """
    drain = 2.0
    r = run_trio(tls, drain, cma=False)
    assert r["session_workers"] == 2, r
    assert r["end"] == "TransportError", r
    assert "halted the UCX worker of this sender's session" in str(r["error"]), r
    assert drain <= float(r["end_after_s"]) < drain + 3.0, r  # type: ignore[arg-type]
    assert r["sessions_halted"] == 1, r
    assert r["landed_after_end"] == 0, r
    assert r["guards"] == 0, r
    assert r["path_closed"] is False and r["grant_after"] == "ok", r
    assert r["senders"] == 1, r  # A's session is gone, B's stays
    check_b(r, during=True)


def test_without_session_workers_the_whole_path_closes() -> None:
    """The same over one shared worker (``session_workers=False``): B's path is lost too.

    This is what the per-session workers fix; the test shows the scenario
    above really stalls a receive.
    """
    r = run_trio("tcp,sm,self", 2.0, workers=False, cma=False)
    assert r["session_workers"] == 0, r
    assert r["end"] == "TransportError" and r["path_closed"] is True, r
    b = r["b"]
    assert isinstance(b, list)
    assert any(x[2] != "done" for x in b), b  # B's transfers failed with the path


RETIRE = (
    """
import gc, os, sys, trio, weakref, numpy as np
from pddnet.kv import ByteRanges
from pddnet.transport.local import UcxReceiver, UcxSender
from pddnet.transport.local import _rx_sessions

SECRET = b"pddnet-session-workers-secret-01"
R = ByteRanges.build([0, 0], [0, 1 << 20], [1 << 20, 1 << 20], [0, 0])

def fds():
    return len(os.listdir("/proc/self/fd"))

async def one(rx, tx, i):
    src = np.random.default_rng(i).integers(0, 256, 2 << 20, dtype=np.uint8)
    dst = np.zeros(2 << 20, np.uint8)
    g = rx.grant([dst], R, timeout=10)
    with trio.fail_after(10):
        await tx.send(g, [src], R)
        await rx.wait_transfer(g.transfer_id)
    assert np.array_equal(src, dst), i

async def main():
    async with UcxReceiver(secret=SECRET) as rx:
        async with UcxSender(rx.address, secret=SECRET) as tx:
            await one(rx, tx, 0)  # UCX's lazily made resources exist from here on
        await trio.sleep(1.0)
        base = fds()
        gc.disable()  # a retired worker must go with its last reference, not in a GC cycle
        for i in range(1, 6):  # senders come and go: their workers go with them
            async with UcxSender(rx.address, secret=SECRET) as tx:
                await one(rx, tx, i)
                ref = weakref.ref(next(iter(rx._sessions.live.values())).worker)
            await trio.sleep(0.7)  # BYE's grace (0.5 s)
            st = rx.statistics()
            print("LIVE", st.session_workers, ref() is None, flush=True)
        gc.enable()
        gc.collect()  # the senders (in this process too) hold their own workers in cycles
        st = rx.statistics()
        print("AFTER", st.session_workers, st.senders, fds() - base, flush=True)
        # the bound: at most 2 workers; a third sender evicts the oldest idle session
        _rx_sessions.K_MAX_SESSION_WORKERS = 2
        async with UcxSender(rx.address, secret=SECRET) as a:
            await one(rx, a, 10)
            async with UcxSender(rx.address, secret=SECRET) as b:
                await one(rx, b, 11)
                async with UcxSender(rx.address, secret=SECRET) as c:
                    await one(rx, c, 12)
                    st = rx.statistics()
                    print("BOUND", st.session_workers, st.senders, flush=True)

"""
    + RUN_MAIN
)


def test_session_workers_are_retired_and_bounded() -> None:
    """A sender's BYE retires its session's worker (fds come back); at the bound
    the oldest idle session goes to make room."""
    env = {**os.environ, "UCX_TLS": "tcp,sm,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RETIRE)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    live = [x.split()[1:] for x in lines if x.startswith("LIVE")]
    assert live == [["0", "True"]] * 5, lines  # each session's worker went after its BYE
    after = next(x.split() for x in lines if x.startswith("AFTER"))
    assert after[1:3] == ["0", "0"], lines
    assert abs(int(after[3])) <= 2, lines  # no fd leak per session (a worker is ~11 fds)
    bound = next(x.split() for x in lines if x.startswith("BOUND"))
    assert bound[1:3] == ["2", "2"], lines
