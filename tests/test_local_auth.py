"""The local path authenticates senders before any receive is posted into granted memory.

UCX runs in child processes (real ucxx endpoints, separate processes for the
receiver and the senders) that end with ``os._exit``; every step is bounded
by ``trio.fail_after`` in the child and a subprocess timeout here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import trio

from pddnet import AuthError
from pddnet._optional import available

sys.path.insert(0, str(Path(__file__).parent))
from ucx_child import RUN_MAIN

UCX = available("ucxx._lib.libucxx")
ucx = pytest.mark.skipif(not UCX, reason="ucxx is not installed")
ENV = {
    **os.environ,
    "UCX_TLS": os.environ.get("UCX_TLS", "tcp,sm,self"),
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}
SECRET = b"local-path-secret-0123456789"

RX = (
    """
import json, os, sys, trio, numpy as np
from pddnet import AuthError
from pddnet.kv import ByteRanges
from pddnet.transport import TransferState
from pddnet.transport.local import UcxReceiver

SECRET = sys.argv[1].encode()
LENS = [4096, 20000, 100]  # eager and rendezvous pieces
RANGES = ByteRanges.build([0, 0, 0], [0, 8192, 40000], LENS, [0, 0, 0])

async def main():
    a = np.full(1 << 16, 0xA5, np.uint8)  # granted, attacked, never sent honestly
    b = np.full(1 << 16, 0xA5, np.uint8)  # granted, sent by the honest sender
    async with UcxReceiver(secret=SECRET, auth_timeout=3) as rx:
        ga = rx.grant([a], RANGES, timeout=60)
        gb = rx.grant([b], RANGES, timeout=60)
        print(json.dumps([[g.transfer_id, g.total, g.address] for g in (ga, gb)]), flush=True)
        with trio.fail_after(30):
            await rx.wait_transfer(gb.transfer_id)
            while rx.statistics().auth_failures < 3:  # wrong secret, no secret, raw HELLO
                await trio.sleep(0.01)
        want = np.full(1 << 16, 0xA5, np.uint8)
        for i, (o, n) in enumerate(zip([0, 8192, 40000], LENS)):
            want[o : o + n] = (np.arange(n) * 7 + i) % 251
        st = rx.statistics()
        print(json.dumps({
            "b_equal": bool(np.array_equal(b, want)),
            "a_untouched": bool((a == 0xA5).all()),
            "a_unbound": rx._grants.transfers[ga.transfer_id].sender is None,
            "a_running": rx._grants.transfers[ga.transfer_id].state is TransferState.RUNNING,
            "auth_failures": st.auth_failures,
            "errors_typed": all(isinstance(e, AuthError) for e in rx.auth_errors),
            "errors": [str(e) for e in rx.auth_errors],
            "admitted": st.sessions_admitted,
            "dropped": st.unauthenticated_dropped,
            "posted": st.pieces_posted,
        }), flush=True)

"""
    + RUN_MAIN
)

TX = (
    """
import json, os, sys, trio, numpy as np
from pddnet import AuthError
from pddnet.kv import ByteRanges
from pddnet.transport import Grant
from pddnet.transport.local import UcxSender, UcxWorker
from pddnet.transport.local._auth import K_TAG_CTRL_RX, legacy_tags
from pddnet.transport.local._addressing import parse_address
from pddnet.transport.local._messages import Ctl as _Ctl, pack as _pack

SECRET = sys.argv[1].encode()
LENS = [4096, 20000, 100]
RANGES = ByteRanges.build([0, 0, 0], [0, 8192, 40000], LENS, [0, 0, 0])
(ta, na, addr), (tb, nb, _) = json.loads(sys.stdin.readline())
ga, gb = Grant(ta, na, (), addr), Grant(tb, nb, (), addr)
peer = addr.split("#")[0]
junk = np.full(1 << 16, 0xEE, np.uint8)
out = {}

async def refused(**kw):
    try:
        with trio.fail_after(10):
            async with UcxSender(peer, **kw) as tx:
                tx.start(ga, [junk], RANGES)
    except AuthError as exc:
        return str(exc)
    return None

async def raw_attack():
    # No handshake at all: a plain HELLO, then START and data on the legacy tags.
    w = UcxWorker()
    ignore = lambda req, err: None
    async with trio.open_nursery() as n:
        await n.start(w.run)
        ep = w.connect(parse_address(peer)[1])
        sid = 0x1234
        w.send(ep, _pack(_Ctl.HELLO, sid, 0, 0, w.address), K_TAG_CTRL_RX, ignore)
        for tid in (ta, tb):
            w.send(ep, _pack(_Ctl.START, sid, tid), K_TAG_CTRL_RX, ignore)
            for i, n_ in enumerate(LENS):
                w.send(ep, junk[:n_], legacy_tags(sid).data_tag(tid, i), ignore)
        await trio.sleep(0.5)
        n.cancel_scope.cancel()

async def main():
    out["wrong_secret"] = await refused(secret=b"not-the-secret-0123456789", auth_timeout=5)
    out["no_secret"] = await refused(auth_timeout=5)
    await raw_attack()
    src = np.zeros(1 << 16, np.uint8)
    for i, (o, n) in enumerate(zip([0, 8192, 40000], LENS)):
        src[o : o + n] = (np.arange(n) * 7 + i) % 251
    with trio.fail_after(20):
        async with UcxSender(peer, secret=SECRET) as tx:
            await tx.send(gb, [src], RANGES, timeout=15)
    out["honest"] = "sent"
    print(json.dumps(out), flush=True)

"""
    + RUN_MAIN
)


@pytest.mark.ucx
@ucx
def test_ucx_auth_between_processes() -> None:
    """Wrong secret, no secret, a raw UCX peer: refused, nothing lands; the right secret works."""
    rx = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(RX), SECRET.decode()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert rx.stdout is not None
        line = rx.stdout.readline()
        assert line.startswith("["), rx.stderr.read() if rx.stderr else line
        tx = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(TX), SECRET.decode()],
            input=line,
            capture_output=True,
            text=True,
            timeout=90,
            env=ENV,
        )
        assert tx.returncode == 0, tx.stderr[-3000:]
        sent = json.loads(tx.stdout.strip().splitlines()[-1])
        out, err = rx.communicate(timeout=60)
        assert rx.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    # the sender side: typed errors
    assert sent["wrong_secret"] and "verify" in sent["wrong_secret"], sent
    assert sent["no_secret"] and "requires authentication" in sent["no_secret"], sent
    assert sent["honest"] == "sent"
    # the receiver side: typed errors, nothing written, nothing posted for strangers
    assert got["auth_failures"] == 3 and got["errors_typed"], got
    assert any("rejected" in e for e in got["errors"]), got  # the wrong-secret sender's FAIL
    assert any("skipped" in e for e in got["errors"]), got  # no secret / raw HELLO
    assert got["a_untouched"] and got["a_unbound"] and got["a_running"], got
    assert got["b_equal"], got
    assert got["admitted"] == 1 and got["posted"] == 3, got  # only the honest session's pieces
    assert got["dropped"] >= 2, got  # the raw peer's STARTs on the public inbox


PAIR = (
    """
import os, sys, trio
from contextlib import asynccontextmanager
from pddnet import AuthError
from pddnet.transport.local import UcxReceiver, UcxSender
from pddnet.transport.testing import check_transport

K = b"local-path-secret-0123456789"

POLL = {}

@asynccontextmanager
async def maker():
    async with UcxReceiver(secret=K, **POLL) as rx:
        async with UcxSender(rx.address, secret=K, **POLL) as tx:
            yield tx, rx

async def main():
    ran = await check_transport(maker)
    print("PASSED", len(ran), flush=True)
    POLL["busy_poll_us"] = 200.0  # the low-latency mode passes the same suite
    POLL["busy_poll_max_bytes"] = 1 << 30
    ran = await check_transport(maker)
    print("POLLED", len(ran), flush=True)
    # a sender with a secret, a receiver without one: the sender is refused
    async with UcxReceiver() as rx:
        try:
            with trio.fail_after(10):
                async with UcxSender(rx.address, secret=K):
                    pass
        except AuthError as exc:
            print("REFUSED", rx.statistics().auth_failures, exc, flush=True)
    # a receiver that never answers: a bounded AuthError, not a hang
    async with UcxReceiver(secret=K) as rx:
        rx._admission.on_hello = lambda *a: None  # deaf: ignores every HELLO
        try:
            with trio.fail_after(10):
                async with UcxSender(rx.address, secret=K, auth_timeout=0.5):
                    pass
        except AuthError as exc:
            print("TIMEOUT", exc, flush=True)

"""
    + RUN_MAIN
)


@pytest.mark.ucx
@ucx
def test_ucx_conformance_with_secret_and_mismatches() -> None:
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PAIR)],
        capture_output=True,
        text=True,
        timeout=90,
        env=ENV,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "PASSED 10" in r.stdout and "POLLED 10" in r.stdout, r.stdout
    assert "REFUSED 1" in r.stdout and "requires authentication" not in r.stdout, r.stdout
    assert "TIMEOUT" in r.stdout and "did not complete authentication" in r.stdout, r.stdout


def test_session_tags_are_secret_and_distinct() -> None:
    from pddnet.transport.local._auth import (
        K_TAG_CTRL_RX,
        legacy_tags,
        session_tags,
    )

    n1, n2 = bytes(range(32)), bytes(range(32, 64))
    a = session_tags(SECRET, n1, n2, 7)
    assert a == session_tags(SECRET, n1, n2, 7)
    assert a != session_tags(b"another-secret-0123456789", n1, n2, 7)
    assert a != session_tags(SECRET, n2, n1, 7) and a != session_tags(SECRET, n1, n2, 8)
    assert a.mask and a.mask < 1 << 56 and a.rx_tag >> 60 == 0xE and a.tx_tag >> 60 == 0xF
    tags = {a.data_tag(tid, p) for tid in (1, 2, 0xFFFFFFFF) for p in (0, 1, (1 << 24) - 1)}
    assert len(tags) == 9 and all(t >> 60 == 0x8 for t in tags)  # a bijection, data space
    legacy = legacy_tags(5)
    assert legacy.rx_tag == K_TAG_CTRL_RX and legacy.data_tag(1, 2) == (0x8 << 60 | 1 << 24 | 2)


def test_short_secret_is_refused() -> None:
    from pddnet.transport.local import UcxSender

    if not UCX:
        pytest.skip("ucxx is not installed")
    with pytest.raises(AuthError):
        UcxSender("ucx:1:" + "AAAA", secret=b"short")


async def test_tcp_fallback_authenticates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ucxx the local path is TCP, with the same handshake: a wrong secret moves nothing."""
    from pddnet.transport.local import _fallback
    from pddnet.transport.testing import make_case
    from pddnet.transport.wan import WanReceiver, WanSender

    monkeypatch.setattr(_fallback, "local_available", lambda: False)
    case = make_case(5, 50_000, pieces=3)
    before = [d.copy() for d in case.dst]
    rx = _fallback.open_local_receiver(secret=SECRET, busy_poll_us=100.0)
    assert isinstance(rx, WanReceiver)
    async with rx:
        bad = _fallback.open_local_sender(rx.address, secret=b"wrong-secret-0123456789")
        assert isinstance(bad, WanSender)
        g = rx.grant(case.dst, case.dst_ranges, timeout=30)
        async with bad:
            t = bad.start(g, case.src, case.src_ranges)
            with trio.fail_after(10):
                while rx.statistics().auth_failures == 0:
                    await trio.sleep(0.01)
            t.cancel()
        assert bad.auth_failures >= 1
        assert all(np.array_equal(a, b) for a, b in zip(case.dst, before, strict=True))
        good = _fallback.open_local_sender(rx.address, secret=SECRET, auth_timeout=3.0)
        assert isinstance(good, WanSender)
        async with good:
            g2 = rx.grant(case.dst, case.dst_ranges, timeout=30)
            with trio.fail_after(10):
                await good.send(g2, case.src, case.src_ranges)
                await rx.wait_transfer(g2.transfer_id)
    case.check_complete()


INLINE = (
    """
import os, sys, trio, numpy as np
from pddnet import RemoteProtocolError
from pddnet.kv import ByteRanges
from pddnet.transport.local import UcxReceiver, UcxSender
from pddnet.transport.local._messages import Ctl as _Ctl, pack as _pack

K = b"local-path-secret-0123456789"
RANGES = ByteRanges.build([0, 0, 0], [0, 1000, 3000], [500, 1200, 2396], [0, 0, 0])  # 4 KiB

async def main():
    src = np.random.default_rng(1).integers(0, 256, 8192, dtype=np.uint8)
    dst = np.full(8192, 0xA5, np.uint8)
    async with UcxReceiver(secret=K) as rx, UcxSender(rx.address, secret=K,
                                                     busy_poll_us=300) as tx:
        g = rx.grant([dst], RANGES, timeout=10)
        with trio.fail_after(10):
            await tx.send(g, [src], RANGES)
            await rx.wait_transfer(g.transfer_id)
        want = np.full(8192, 0xA5, np.uint8)
        for o, n in ((0, 500), (1000, 1200), (3000, 2396)):
            want[o : o + n] = src[o : o + n]
        st = tx.statistics()
        print("INLINE", st.inline_transfers, st.pieces_sent, np.array_equal(dst, want), flush=True)
        # a DATA message one byte short: rejected, nothing written
        before = dst.copy()
        g2 = rx.grant([dst], RANGES, timeout=10)
        msg = _pack(_Ctl.DATA, tx.sender_id, g2.transfer_id, 0, b"\\xee" * (4096 - 1))
        tx._service.send_ctrl(tx._session.data_ep, tx._session.tags.rx_tag, msg)
        try:
            with trio.fail_after(10):
                await rx.wait_transfer(g2.transfer_id)
        except RemoteProtocolError as exc:
            print("REJECTED", np.array_equal(dst, before), exc, flush=True)

"""
    + RUN_MAIN
)


@pytest.mark.ucx
@ucx
def test_small_transfer_inline_and_exact() -> None:
    """A 4 KiB grant of three pieces travels in one DATA message; a wrong size is refused."""
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(INLINE)],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "INLINE 1 3 True" in r.stdout, r.stdout
    assert "REJECTED True" in r.stdout, r.stdout


POLL_RX = (
    """
import json, os, sys, trio, numpy as np
from pddnet.kv import ByteRanges
from pddnet.transport.local import UcxReceiver

K = b"local-path-secret-0123456789"
SIZES = [4096] * 100 + [1 << 20, 3000, 1 << 20]

async def main():
    dst = np.zeros(sum(SIZES), np.uint8)
    async with UcxReceiver(secret=K, busy_poll_us=300) as rx:
        offs = np.concatenate(([0], np.cumsum(SIZES)[:-1]))
        gs = [rx.grant([dst], ByteRanges.build([0], [int(o)], [n], [0]), timeout=30)
              for o, n in zip(offs, SIZES)]
        print(json.dumps({"address": rx.address,
                          "grants": [[g.transfer_id, g.total, g.address] for g in gs]}), flush=True)
        with trio.fail_after(60):
            for g in gs:
                await rx.wait_transfer(g.transfer_id)
        want = (np.arange(dst.size) % 253).astype(np.uint8)
        print("RX", np.array_equal(dst, want), rx._service.worker.poll_rounds > 0, flush=True)

"""
    + RUN_MAIN
)

POLL_TX = (
    """
import json, os, sys, trio, numpy as np
from pddnet.kv import ByteRanges
from pddnet.transport import Grant
from pddnet.transport.local import UcxSender

K = b"local-path-secret-0123456789"

async def main():
    hello = json.loads(sys.stdin.readline())
    gs = [Grant(t, n, (), a) for t, n, a in hello["grants"]]
    src = (np.arange(sum(g.total for g in gs)) % 253).astype(np.uint8)
    async with UcxSender(hello["address"], secret=K, busy_poll_us=300) as tx:
        off = 0
        with trio.fail_after(60):
            for g in gs:  # one at a time, as the latency bench does
                await tx.send(g, [src], ByteRanges.build([0], [off], [g.total], [0]))
                off += g.total
        st = tx.statistics()
        print("TX", st.transfers_done, st.inline_transfers, st.poll_rounds > 0, flush=True)

"""
    + RUN_MAIN
)


@pytest.mark.ucx
@ucx
def test_low_latency_mode_between_processes() -> None:
    """Both sides busy-poll: small (inline) and large transfers all land, in order."""
    rx = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(POLL_RX)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert rx.stdout is not None
        line = rx.stdout.readline()
        assert line.startswith("{"), rx.stderr.read() if rx.stderr else line
        tx = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(POLL_TX)],
            input=line,
            capture_output=True,
            text=True,
            timeout=90,
            env=ENV,
        )
        assert tx.returncode == 0, tx.stderr[-3000:]
        out, err = rx.communicate(timeout=60)
        assert rx.returncode == 0, err[-3000:]
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    assert "TX 103 101 True" in tx.stdout, tx.stdout  # 100 x 4 KiB and 3000 B went inline
    assert "RX True True" in out, out
