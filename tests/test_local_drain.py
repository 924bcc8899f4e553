"""The local path never reports a grant ended while UCX can still write into it.

When a grant ends (the receiver cancels it, its deadline passes, the sender
cancels) the engine frees its blocks and may reuse them at once. UCX cannot
cancel a tag receive whose message already matched (a rendezvous transfer in
flight): it goes on writing until it completes. So the receiver reports the
end only once every posted receive completed or was confirmed cancelled, and
halts its UCX worker if that does not happen within ``drain_timeout``.

Each test: a real sender process starts one large (rendezvous) piece over
``UCX_TLS=tcp`` (one also over shared memory); the receiver process sees the
first bytes land, stops the sender (SIGSTOP), ends the grant, waits for the end to be reported, then
overwrites the region (the engine reusing the blocks), lets the sender go on,
and checks that the region still holds only the engine's bytes. Before the
fix every case failed: the end was reported at once and tens of MiB of the
old payload landed in the reused blocks afterwards.
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
from ucx_child import FILES

UCX = available("ucxx._lib.libucxx")
ENV = {**os.environ, "UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n"}

COMMON = (
    """
import json, os, signal, sys, time, trio, numpy as np
from pddnet import PddnetError
from pddnet.kv import ByteRanges
from pddnet.transport import Grant
from pddnet.transport.local import UcxReceiver, UcxSender

D, MODE, N, TLS = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
SECRET = b"pddnet-drain-test-secret-0123"
G = 4096  # guard bands on both sides of the granted region
NEW = 0x55  # the engine's bytes after it reused the blocks; the sender sends 0xAB

"""
    + FILES
)

RECEIVER = (
    COMMON
    + """
async def main():
    pool = np.zeros(N + 2 * G, np.uint8)
    region = pool[G : G + N]
    ranges = ByteRanges.build([0], [G], [N], [0])
    drain = 2.0 if MODE in ("cancel_hold", "halt_tell") else 20.0
    out = {}
    async with trio.open_nursery() as nursery, UcxReceiver(
        secret=SECRET, tls=TLS, drain_timeout=drain
    ) as rx:
        put("addr", rx.address)
        pid = int(await get("txpid"))  # admitted: the grant's clock starts now
        if MODE == "halt_tell":  # a second transfer of the same session, never made ready
            other = np.zeros(1 << 20, np.uint8)
            g2 = rx.grant([other], ByteRanges.build([0], [0], [1 << 20], [0]), timeout=60)
            put("grant2", grant_text(g2))
        g = rx.grant([pool], ranges, timeout=1.5 if MODE == "timeout" else 60)
        put("grant", grant_text(g))
        sample = region[::4096]
        with trio.fail_after(20):
            while not sample.any():  # the first bytes of the payload landed
                await trio.sleep(0.0003)
        os.kill(pid, signal.SIGSTOP)
        await trio.sleep(0.05)  # what the kernel already buffered lands
        out["landed_before_end"] = float(np.count_nonzero(sample) / sample.size)
        if sample.all():
            os.kill(pid, signal.SIGCONT)
            print("RACED", flush=True)  # it all arrived before the stop: try again
            os._exit(3)
        resumed = trio.Event()

        async def resume(after):
            await trio.sleep(after)
            os.kill(pid, signal.SIGCONT)
            resumed.set()

        ended = trio.Event()

        async def wait_end():
            try:
                with trio.fail_after(30):
                    await rx.wait_transfer(g.transfer_id)
                out["end"] = "done"
            except PddnetError as exc:
                out["end"], out["error"] = type(exc).__name__, str(exc)
            out["resumed_before_end"] = resumed.is_set()
            region[:] = NEW  # the engine reuses the blocks at once
            ended.set()

        if MODE in ("cancel_hold", "halt_tell"):  # the sender stays stopped until the end
            rx.cancel(g.transfer_id)
        elif MODE == "cancel_pause":  # it goes on 0.3 s after the cancel
            rx.cancel(g.transfer_id)
            nursery.start_soon(resume, 0.3)
        elif MODE == "timeout":  # it goes on after the grant's deadline passed
            nursery.start_soon(resume, 2.0)
        elif MODE == "sender_cancel":  # it goes on and cancels the transfer itself
            put("cancel_now", "1")
            nursery.start_soon(resume, 0.05)
        if MODE == "close":  # the receiver closes; the sender goes on 0.3 s later
            nursery.start_soon(wait_end)
            nursery.start_soon(resume, 0.3)
            await trio.sleep(0.01)
            await rx.aclose()
            await ended.wait()
        else:
            await wait_end()
        if MODE in ("cancel_hold", "halt_tell"):
            os.kill(pid, signal.SIGCONT)
        if MODE == "halt_tell":  # what the resumed sender learnt
            out["sender"] = json.loads(await get("sender_out", 20))
        await trio.sleep(1.0)  # the rest of the old payload, if anything, arrives now
        out["landed_after_end"] = int(np.count_nonzero(region != NEW))
        out["guards"] = int(np.count_nonzero(pool[:G])) + int(np.count_nonzero(pool[G + N :]))
        st = rx.statistics()
        out["path_closed"], out["drains"] = st.path_closed, st.drains
        out["sessions_halted"] = st.sessions_halted
        try:
            if MODE == "close":
                raise PddnetError("closed")
            rx.grant([pool], ranges)
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
    src = np.full(N, 0xAB, np.uint8)
    ranges = ByteRanges.build([0], [0], [N], [0])
    async with UcxSender(await get("addr"), secret=SECRET, tls=TLS) as tx:
        put("txpid", str(os.getpid()))
        if MODE == "halt_tell":  # its START binds the second grant to this session
            src2 = np.full(1 << 20, 0xCD, np.uint8)
            r2 = ByteRanges.build([0], [0], [1 << 20], [0])
            g2 = grant_of(await get("grant2"))
            t2 = tx.start(g2, [src2], r2, ready=False, timeout=60)
        g = grant_of(await get("grant"))
        t = tx.start(g, [src], ranges, timeout=60)

        async def cancel_when_told():
            await get("cancel_now", 60)
            t.cancel()

        async with trio.open_nursery() as nursery:
            if MODE == "sender_cancel":
                nursery.start_soon(cancel_when_told)
            try:
                await t.wait()
                print("SENT", flush=True)
            except PddnetError as exc:
                print("ENDED", type(exc).__name__, flush=True)
            nursery.cancel_scope.cancel()
        if MODE == "halt_tell":
            res = {}
            try:
                with trio.fail_after(10):
                    await t2.wait()
                res["t2"] = "done"
            except PddnetError as exc:
                res["t2"], res["t2_error"] = type(exc).__name__, str(exc)
            except trio.TooSlowError:
                res["t2"] = "no end within 10 s"
            try:
                tx.start(g2, [src2], r2)
                res["start_after"] = "ok"
            except PddnetError as exc:
                res["start_after"] = type(exc).__name__
            put("sender_out", json.dumps(res))
        await trio.sleep(30)  # a live sender (P) keeps its worker going; killed by the test

finish(main)
"""
)


def run_pair(mode: str, size: int = 64 << 20, tls: str = "tcp") -> dict[str, object]:
    """Receiver and sender in two processes; retried if the payload beat the SIGSTOP."""
    for _attempt in range(3):
        with tempfile.TemporaryDirectory() as d:
            args = [d, mode, str(size), tls]
            rx = subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(RECEIVER), *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=ENV,
            )
            tx = subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(SENDER), *args],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=ENV,
            )
            try:
                out, err = rx.communicate(timeout=60)
            finally:
                for p in (rx, tx):
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            if rx.returncode == 3 and "RACED" in out:
                continue
            assert rx.returncode == 0, err[-3000:]
            line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
            result: dict[str, object] = json.loads(line[len("RESULT ") :])
            return result
    pytest.fail("the whole payload arrived before the sender could be stopped, 3 times")


pytestmark = [pytest.mark.ucx, pytest.mark.skipif(not UCX, reason="ucxx is not installed")]


@pytest.mark.parametrize("tls", ["tcp", "tcp,posix,sysv,self"])
def test_receiver_cancel_waits_for_the_receive_in_flight(tls: str) -> None:
    """Cancelled mid-payload; the sender goes on 0.3 s later: the end waits for it.

    Also over shared memory without ``cma`` (the FIFO carries the rendezvous
    fragments, so the stalled sender holds them back too). With ``cma`` UCX's
    rendezvous is a GET the receiver completes inside one progress call: no
    window was seen there.
    """
    r = run_pair("cancel_pause", tls=tls)
    assert r["end"] == "TransferCancelled", r
    assert r["landed_after_end"] == 0, r  # before the fix: the rest of the payload
    assert r["guards"] == 0, r
    assert r["resumed_before_end"] is True, r
    assert r["drains"] == 1 and r["path_closed"] is False, r
    assert r["grant_after"] == "ok", r  # the path stays usable


def test_stalled_sender_halts_its_session_after_the_drain_deadline() -> None:
    """The sender stays stopped: after drain_timeout its session's worker is halted.

    A typed error, nothing lands afterwards, and the receiver stays open (each
    sender session has its own UCX worker; tests/test_local_session_workers.py
    has other senders going on meanwhile, and the whole-path halt without them).
    """
    r = run_pair("cancel_hold")
    assert r["landed_after_end"] == 0, r  # the sender resumed, nothing more landed
    assert r["end"] == "TransportError", r
    assert "halted the UCX worker of this sender's session" in str(r["error"]), r
    assert r["guards"] == 0, r
    assert r["path_closed"] is False and r["sessions_halted"] == 1, r
    assert r["grant_after"] == "ok", r


def test_a_halted_session_tells_its_sender() -> None:
    """The session's worker is halted while the sender is stopped; once it goes on,
    its other running transfer fails at once (not at its own 60 s deadline), and
    so does a new ``start``: the receiver said so through its public worker."""
    r = run_pair("halt_tell")
    assert r["end"] == "TransportError" and r["sessions_halted"] == 1, r
    sender = r["sender"]
    assert isinstance(sender, dict), r
    assert sender["t2"] == "TransportError", r  # without the notice: "no end within 10 s"
    assert "halted the UCX worker of this sender's session" in sender["t2_error"], r
    assert sender["start_after"] == "TransportError", r
    assert r["landed_after_end"] == 0 and r["guards"] == 0, r
    assert r["path_closed"] is False and r["grant_after"] == "ok", r


def test_grant_deadline_waits_for_the_receive_in_flight() -> None:
    """The grant times out mid-payload; the sender goes on after the deadline."""
    r = run_pair("timeout")
    assert r["end"] == "TransferTimeout", r
    assert r["landed_after_end"] == 0, r
    assert r["guards"] == 0, r
    assert r["resumed_before_end"] is True, r


def test_sender_cancel_mid_payload_lands_nothing_after_the_end() -> None:
    """The sender cancels mid-payload (its UCX send cannot be cancelled and goes on).

    Over one tcp lane the sender's CANCEL queues behind the payload already
    posted, so the receiver mostly sees the piece complete first (``done``) or
    the CANCEL after it; either way nothing may land after the reported end.
    """
    r = run_pair("sender_cancel")
    assert r["end"] in ("TransferCancelled", "done"), r
    assert r["landed_after_end"] == 0, r
    assert r["guards"] == 0, r


def test_receiver_closing_waits_for_the_receive_in_flight() -> None:
    """``aclose`` mid-payload: waiters learn of the end only once the receive stopped."""
    r = run_pair("close")
    assert r["end"] == "TransferCancelled", r
    assert r["landed_after_end"] == 0, r
    assert r["guards"] == 0, r
    assert r["resumed_before_end"] is True, r  # before the fix: reported at once
    assert r["drains"] == 1 and r["path_closed"] is False, r
