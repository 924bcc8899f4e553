"""The local (UCX) path: conformance, a transfer between two processes, and the fallback.

UCX runs only in child processes that end with ``os._exit`` (UCX can hang or
crash in interpreter teardown), each bounded by a timeout.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pddnet import LocalProtocolError, RemoteProtocolError
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


def run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


CONFORMANCE = (
    """
import os, sys, trio
from contextlib import asynccontextmanager
from pddnet.transport.local import UcxReceiver, UcxSender
from pddnet.transport.testing import check_transport

@asynccontextmanager
async def maker():
    async with UcxReceiver() as rx:
        async with UcxSender(rx.address, max_inflight=int(sys.argv[1])) as tx:
            yield tx, rx

async def main():
    ran = await check_transport(maker)
    print("PASSED", " ".join(ran), flush=True)

"""
    + RUN_MAIN
)


@pytest.mark.ucx
@ucx
@pytest.mark.parametrize("inflight", [16, 1])
def test_conformance(inflight: int) -> None:
    """Both ends in one child process, on separate UCX contexts and workers."""
    r = run_child(CONFORMANCE, str(inflight))
    assert r.returncode == 0, r.stderr[-3000:]
    ran = r.stdout.split("PASSED", 1)[1].split()
    assert "deadlines" in ran and "layers" in ran and len(ran) == 10


PEER = """
import json, os, sys, trio, numpy as np
from pddnet.kv import KVLayout, KVPool, TransferPlan
from pddnet.transport import Grant
from pddnet.transport.local import UcxReceiver, UcxSender

role, seed = sys.argv[1], int(sys.argv[2])
layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, kv_major=True)
rng = np.random.default_rng(seed)
src_ids = rng.permutation(200)[:90]
dst_ids = np.sort(rng.permutation(300)[:90])  # runs on the destination side
plan = TransferPlan.build(layout, 200, src_ids, 300, dst_ids)

def source():
    pool = KVPool.allocate(layout, 200, fill=None)
    for b in pool.buffers:
        b.view(np.uint8)[...] = np.random.default_rng(seed + 1).integers(0, 256, b.nbytes,
                                dtype=np.uint8).reshape(b.view(np.uint8).shape)
    return pool

async def receiver():
    pool = KVPool.allocate(layout, 300, fill=0xA5)
    async with UcxReceiver() as rx:
        g = rx.grant(pool.host_views(), plan.dst, num_layers=layout.num_layers, timeout=30)
        print(json.dumps([g.transfer_id, g.total, list(g.layer_ends), g.address]), flush=True)
        for layer in range(layout.num_layers):
            await rx.wait_layer(g.transfer_id, layer)
        await rx.wait_transfer(g.transfer_id)
        want = source().read(plan.src)
        assert pool.read(plan.dst) == want, "destination differs"
        untouched = KVPool.allocate(layout, 300, fill=0xA5)
        keep = np.setdiff1d(np.arange(300), dst_ids)
        rng_ = untouched.ranges(keep)
        assert pool.read(rng_) == untouched.read(rng_), "bytes outside the grant changed"
        print("VERIFIED", g.total, flush=True)

async def sender():
    tid, total, ends, address = json.loads(sys.stdin.readline())
    g = Grant(tid, total, tuple(ends), address)
    pool = source()
    async with UcxSender(address.split("#")[0]) as tx:
        t = tx.start(g, pool.host_views(), plan.src, ready=False, timeout=30)
        for layer in range(layout.num_layers):  # as prefill produces layers
            t.mark_layer_ready(layer)
            await trio.sleep(0.01)
        await t.wait()
        print("SENT", tx.statistics().bytes_sent, tx.statistics().bytes_staged, flush=True)

try:
    trio.run(receiver if role == "rx" else sender)
except BaseException:
    import traceback; traceback.print_exc(); sys.stderr.flush(); os._exit(1)
os._exit(0)
"""


@pytest.mark.ucx
@ucx
def test_two_processes_bit_for_bit() -> None:
    """A KV plan between two processes: layers stream in, bytes match, nothing else moves."""
    seed = "7"
    rx = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PEER), "rx", seed],
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
            [sys.executable, "-c", textwrap.dedent(PEER), "tx", seed],
            input=line,
            capture_output=True,
            text=True,
            timeout=60,
            env=ENV,
        )
        assert tx.returncode == 0, tx.stderr[-3000:]
        out, err = rx.communicate(timeout=60)
        assert rx.returncode == 0, err[-3000:]
        total = json.loads(line)[1]
        assert f"VERIFIED {total}" in out
        sent = tx.stdout.split()
        assert sent[0] == "SENT" and int(sent[1]) == total and int(sent[2]) == 0  # zero-copy
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()


# ---------------------------------------------------------------- without UCX
def test_fallback_to_tcp_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from pddnet.transport.local import _fallback
    from pddnet.transport.wan import WanReceiver, WanSender

    monkeypatch.setattr(_fallback, "local_available", lambda: False)
    monkeypatch.setattr(_fallback, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="pddnet.transport.local"):
        rx = _fallback.open_local_receiver(tls="tcp", spin_us=1.0)
        rx2 = _fallback.open_local_receiver()
        tx = _fallback.open_local_sender("tcp://127.0.0.1:9", max_inflight=3)
    assert isinstance(rx, WanReceiver) and isinstance(rx2, WanReceiver)
    assert isinstance(tx, WanSender)
    warnings = [r for r in caplog.records if "falls back to TCP" in r.getMessage()]
    assert len(warnings) == 1


async def test_fallback_pair_moves_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    import trio

    from pddnet.transport.local import _fallback
    from pddnet.transport.testing import make_case

    monkeypatch.setattr(_fallback, "local_available", lambda: False)
    case = make_case(3, 100_000, pieces=4)
    rx = _fallback.open_local_receiver()
    async with rx:  # type: ignore[attr-defined]
        tx = _fallback.open_local_sender(rx.address)
        async with tx:  # type: ignore[attr-defined]
            g = rx.grant(case.dst, case.dst_ranges)
            with trio.fail_after(10):
                await tx.send(g, case.src, case.src_ranges)
                await rx.wait_transfer(g.transfer_id)
    case.check_complete()


def test_control_codec_and_addresses() -> None:
    from pddnet.transport.local import UcxSender
    from pddnet.transport.local._messages import K_CTRL_MAX
    from pddnet.transport.local._messages import Ctl as _Ctl
    from pddnet.transport.local._messages import pack as _pack
    from pddnet.transport.local._messages import unpack as _unpack

    msg = _pack(_Ctl.CANCEL, 0xDEADBEEF, 42, 2, b"x")
    buf = bytearray(K_CTRL_MAX)
    buf[: len(msg)] = msg
    assert _unpack(buf) == (_Ctl.CANCEL, 0xDEADBEEF, 42, 2, b"x")
    with pytest.raises(RemoteProtocolError):
        _unpack(b"\xff\xff\xff\x7f" + b"\0" * 8)
    with pytest.raises(RemoteProtocolError):  # shorter than the fixed header
        _unpack(b"\x03\0\0\0\x03\x01\x02" + b"\0" * 8)
    with pytest.raises(RemoteProtocolError):  # unknown kind
        _unpack(b"\x0a\0\0\0\x63" + b"\0" * 20)
    with pytest.raises(RemoteProtocolError):  # a length past the buffer
        _unpack(b"\x20\0\0\0\x03" + b"\0" * 20)
    with pytest.raises(LocalProtocolError):
        UcxSender("tcp://127.0.0.1:5")


def test_tls_across_network_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared memory is dropped (cma added) only for a receiver in another netns."""
    from pddnet.transport.local import _addressing as tr

    monkeypatch.setattr(tr, "netns_id", lambda: "111")
    monkeypatch.delenv("UCX_TLS", raising=False)
    assert tr.tls_for_peer(None, "111") is None  # same namespace: untouched
    assert tr.tls_for_peer(None, "") is None  # unknown: untouched
    assert tr.tls_for_peer(None, "222") == "tcp,self,cma"
    assert tr.tls_for_peer("rc,posix,sysv,self", "222") == "rc,self,cma"
    assert tr.tls_for_peer("tcp,self", "222") == "tcp,self"
    monkeypatch.setenv("UCX_TLS", "tcp,sm,cma,self")
    assert tr.tls_for_peer(None, "222") == "tcp,cma,self"
    assert tr.parse_address("ucx:222:" + tr.b64(b"abc")) == ("222", b"abc")
    assert tr.parse_address("ucx:" + tr.b64(b"abc")) == ("", b"abc")
    with pytest.raises(LocalProtocolError):
        tr.parse_address("ucx:1:abcde")  # bad padding


MANY_PIECES = (
    """
import os, sys, trio, numpy as np
from pddnet.kv import ByteRanges
from pddnet.transport.local import UcxReceiver, UcxSender
from pddnet.transport.local import _tx_transfers

N = 1000  # > K_INLINE_BURST: the sender's pump yields to trio and resumes

async def main():
    src = np.random.default_rng(7).integers(0, 256, 128 * N, dtype=np.uint8)
    dst = np.zeros(2 * 128 * N, np.uint8)
    offs = np.arange(N) * 128
    sr = ByteRanges.build([0] * N, offs, [128] * N, [0] * N)
    dr = ByteRanges.build([0] * N, 2 * offs, [128] * N, [0] * N)  # gaps: N pieces
    async with UcxReceiver() as rx, UcxSender(rx.address) as tx:
        g = rx.grant([dst], dr, timeout=30)
        with trio.fail_after(30):
            await tx.send(g, [src], sr)
            await rx.wait_transfer(g.transfer_id)
        st = tx.statistics()
        print("INLINE", tx._service.worker.inline_sends, "PIECES", st.pieces_sent, st.bytes_sent)
    got = dst.reshape(N, 256)[:, :128].reshape(-1)
    assert np.array_equal(got, src), "data differs"
    assert not dst.reshape(N, 256)[:, 128:].any(), "wrote into a gap"
    print("OK", _tx_transfers.K_INLINE_BURST < N, flush=True)

"""
    + RUN_MAIN
)


@pytest.mark.ucx
@ucx
def test_many_small_pieces() -> None:
    """1000 separate pieces: every byte lands, gaps stay untouched, all pieces counted."""
    r = run_child(MANY_PIECES)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "OK True" in r.stdout, r.stdout
    assert f"PIECES 1000 {128 * 1000}" in r.stdout, r.stdout


MANY_TRANSFERS = (
    """
import os, sys, trio, numpy as np
from pddnet.kv import ByteRanges
from pddnet.transport.local import UcxReceiver, UcxSender

N = 200

async def main():
    src = np.random.default_rng(3).integers(0, 256, 64 * N, dtype=np.uint8)
    dst = np.zeros(64 * N, np.uint8)
    one = ByteRanges.build([0], [0], [64], [0])
    async with UcxReceiver() as rx, UcxSender(rx.address) as tx:
        grants = [rx.grant([dst[64 * i : 64 * (i + 1)]], one) for i in range(N)]
        ts = [tx.start(g, [src[64 * i : 64 * (i + 1)]], one) for i, g in enumerate(grants)]
        with trio.fail_after(30):
            for t in ts:
                await t.wait()
        st = rx.statistics()
        print("DONE_MESSAGES", st.done_messages, "OK", st.transfers_done, flush=True)
    assert np.array_equal(dst, src), "data differs"
    print("EQUAL", flush=True)

"""
    + RUN_MAIN
)


@pytest.mark.ucx
@ucx
def test_done_messages_are_batched() -> None:
    """200 transfers started at once: all complete, with fewer DONE messages than transfers."""
    r = run_child(MANY_TRANSFERS)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "EQUAL" in r.stdout, r.stdout
    words = r.stdout.split()
    dones = int(words[words.index("DONE_MESSAGES") + 1])
    assert int(words[words.index("OK") + 1]) == 200, r.stdout
    assert 1 <= dones < 200, r.stdout


NS_RX = (
    """
import json, os, sys, trio, numpy as np
from pddnet.kv import ByteRanges
from pddnet.transport.local import UcxReceiver

async def main():
    async with UcxReceiver() as rx:
        buf = np.zeros(1 << 20, np.uint8)
        g = rx.grant([buf], ByteRanges.build([0, 0], [0, 4096], [4096, (1 << 20) - 4096], [0, 0]),
                     timeout=20)
        print(json.dumps([g.transfer_id, g.total, g.address]), flush=True)
        await rx.wait_transfer(g.transfer_id)
        expect = (np.arange(1 << 20) % 251).astype(np.uint8)
        print("RX", np.array_equal(buf, expect), flush=True)

"""
    + RUN_MAIN
)

NS_TX = (
    """
import json, os, sys, trio, numpy as np
from pddnet.kv import ByteRanges
from pddnet.transport import Grant
from pddnet.transport.local import UcxSender

async def main():
    tid, total, addr = json.loads(sys.argv[1])
    src = (np.arange(1 << 20) % 251).astype(np.uint8)
    ranges = ByteRanges.build([0, 0], [0, 4096], [4096, (1 << 20) - 4096], [0, 0])
    async with UcxSender(addr) as tx:
        await tx.send(Grant(tid, total, (), addr), [src], ranges, timeout=20)
        print("TX OK", flush=True)

"""
    + RUN_MAIN
)


@pytest.mark.ucx
@ucx
def test_between_network_namespaces(wan_link) -> None:  # type: ignore[no-untyped-def]
    """P and RLD in their own namespaces, default UCX_TLS (with sm): the transfer arrives.

    Shared memory never delivers across namespaces; the sender must leave it out.
    """
    wan = wan_link(rtt="10ms")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**ENV, "UCX_TLS": "tcp,sm,self", "PYTHONPATH": root}
    rx = wan.rld.spawn(
        [sys.executable, "-c", NS_RX],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert rx.stdout is not None
    grant = rx.stdout.readline().strip()
    assert grant, rx.communicate(timeout=30)[1][-3000:]
    tx = wan.p.spawn(
        [sys.executable, "-c", NS_TX, grant],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    tout, terr = tx.communicate(timeout=60)
    rout, rerr = rx.communicate(timeout=60)
    assert "TX OK" in tout, terr[-3000:]
    assert "RX True" in rout, rerr[-3000:]
