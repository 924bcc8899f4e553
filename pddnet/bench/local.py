"""Local path: pddnet over UCX vs raw ucxx, plain TCP, NIXL and Mooncake, two processes.

Every implementation moves host memory between two processes on this
machine: a sender process transfers ``S`` bytes into a receiver process's
buffer and waits until the receiver confirms (for pddnet, the transport's own
DONE; for the others, an 8-byte acknowledgement or the library's completion
notification). The median over many repetitions is the latency, ``S /
median`` the throughput. Sizes run from 4 KiB to 256 MiB (``--quick``: 4 KiB,
1 MiB, 16 MiB). Grants are made ahead: the control-plane trip of a grant is
not measured (like NIXL's post + wait).

Where the receiver reports it, ``one_way_us`` is the median time from the
sender's start until the *receiver* knows the data landed (both read
``time.perf_counter``, CLOCK_MONOTONIC, one clock for the host's processes).
pddnet rows also give CPU time per transfer (``cpu_us`` sender,
``server_cpu_us`` receiver). The server child is pinned to one CPU and the
client to another unless ``--no-pin`` (busy-polling peers collapse when the
OS puts both on one core).

Rows, each in up to three transport settings (``sm``: ``UCX_TLS=tcp,sm,self``,
which takes shared memory; ``tcp``: ``UCX_TLS=tcp,self`` on this host's
loopback; ``xhost``: two hosts, below):

* ``pddnet``: :class:`~pddnet.transport.local.UcxSender` /
  :class:`~pddnet.transport.local.UcxReceiver` driven from trio (grants made
  ahead, one transfer at a time, authenticated with a shared secret);
* ``pddnet_poll``: the same in the low-latency mode (``busy_poll_us`` =
  ``--poll-us``; ``PDDNET_BENCH_POLL_MAX`` overrides its 64 KiB size limit);
* ``pddnet_spaced``: the default mode with :data:`K_SPACED_GAP_US` of idle
  after each transfer (``xhost`` only): both ends have stopped lingering and
  sleep on epoll when the next one comes, so its ``one_way_us`` and
  ``cpu_us`` / ``server_cpu_us`` are an isolated transfer's (which does not
  linger: the burst gate; ``pddnet`` rows are back to back);
* ``pddnet_nocma``: the receiver without ``cma`` (``UcxReceiver(cma=False)``,
  RLD's default: a killed sender cannot abort it), ``sm`` only: the receiver
  as deployed, behind the summary's headline ratios;
* ``raw_ucxx``: ucxx's tag API in a tight busy-polling loop (no trio, no
  protocol): the ceiling for anything built on ucxx;
* ``raw_ucxx_epoll``: the same, but sleeping on the worker's epoll fd (2 ms
  cap) instead of spinning: the cost of blocking wake-ups alone;
* ``tcp``: blocking Python sockets, ``sendall`` / ``recv_into`` (one stream);
* ``nixl``: NIXL (``nixl-cu12``, UCX backend) WRITE, initiator progress
  thread off, from a separate environment (``--peer-venv``, made on demand);
  a one-sided put: the target is not told;
* ``nixl_notif``: WRITE with a notification, which the target busy-polls for
  (its ``one_way_us`` is the like-for-like "receiver knows" time);
* ``mooncake``: the Mooncake Transfer Engine (``tcp`` protocol), same venv.

A peer that cannot be installed or run gets its exact error in the JSON, and
the run goes on. A peer that is not there at all (ucxx in pddnet's environment,
NIXL or Mooncake in ``--peer-venv``: :data:`K_PEERS`) is named below the table
with how to get it, and in the summary's ``missing_peers``; its rows are not run.

**Cross-host (the headline, ``xhost``).** In a real deployment P and RLD are
different hosts, where shared memory and ``cma`` never apply. The ``xhost``
rows run the receiver in the testbed's ``dc-a-rld`` and the sender in
``dc-a-p`` (network namespaces, a veth each on one bridge, built on first use
and torn down at the end; root only, else the rows' error says why), with
``UCX_TLS=tcp,self`` for every UCX user (pddnet, raw ucxx, NIXL) and the
plain TCP socket to the receiver's address. ``crosshost_ratio_vs_nixl_16mib``,
``crosshost_ratio_vs_tcp_16mib`` and ``crosshost_ratio_vs_raw_ucxx_16mib`` are
medians of paired 16 MiB rounds of :data:`K_CROSSHOST_PAIRED` as below;
``crosshost_gb_per_s_16mib`` is pddnet's median over those rounds;
``one_way_ratio_vs_nixl_notif_4kib`` is pddnet's default mode's 4 KiB
one-way time over NIXL WRITE + notification's, cross-host, from the table.
The same-host keys below stay as they were.

**Layer by layer (``layerwise``, not a table row).** A request as the
PrefillEndpoint ships it: one transfer whose grant names the request's layers
(``num_layers``, ``layer_ends``), for a model of L = 32 and 80 layers (8 KV
heads of 128, fp16, 16-token blocks, K/V-major as vLLM: 512 KiB per layer for
8 blocks, so 16 MiB and 40 MiB). Sent two ways, alternating in one process
pair: whole (``ready=True``), and layer by layer (``ready=False``, then
``mark_layer_ready`` for each layer in order, each as its own event: a trio
checkpoint between marks, no compute in between, so the gaps add nothing but
the protocol's own cost). Both are timed from ``start`` until the sender's
``wait`` returns (the receiver's DONE). ``layerwise_overhead_32`` and
``_80`` (cross-host, the ``xhost`` setting; ``..._sm`` same host) are the
median over pairs of layer-by-layer time / whole time; ``layerwise_us`` holds
the medians, and the sender's CPU time per request of each kind (its
``time.process_time``: over a veth the sender's CPU is what bounds it, and it
moves less than the wall time). ``--only layerwise`` runs it alone.

**The 16 MiB ratios are paired.** On this kind of machine one process pair's
16 MiB time moves by a third from run to run (856-1503 µs over 12 runs of
the same code), more than the differences measured. So
after the table, ``--rounds`` rounds run pddnet as deployed (``pddnet_nocma``),
pddnet with ``cma``, raw ucxx and NIXL (``sm``, 16 MiB) back to back, the
order rotating each round, and each ratio of :data:`K_PAIRED_RATIOS` is the
median of its per-round ratios (each round's processes are fresh, so each
round samples the placement anew). The headline ``ratio_vs_nixl_16mib`` and
``ratio_vs_raw_ucxx_16mib`` use the deployed receiver; ``..._cma`` the one
with ``cma``. A round where either side failed has no ratio: it is None in
``..._rounds``, counted in ``failed_rounds`` and its error is in the JSON's
``errors``. The rounds' times are in ``paired_16mib_us``; the table's
single-pass ratios are kept as ``..._single_pass``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..emu import Testbed, emulated_wan, unavailable_reason
from ._common import add_common_arguments, print_missing, print_table, run_install, write_report

K_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
K_QUICK_SIZES = [4 << 10, 1 << 20, 16 << 20]
# xhost: server in the testbed's dc-a-rld, client in dc-a-p (a veth each, one
# bridge): no shared memory and no cma for anyone, as between two hosts
K_TLS = {"sm": "tcp,sm,self", "tcp": "tcp,self", "xhost": "tcp,self"}
K_PEER_VENV = "/tmp/pdd-bench-venv"
K_POLL_US = 300.0
# pddnet_spaced: idle between transfers, well past the worker's linger
# (transport.local K_LINGER_US): each transfer finds both ends asleep
K_SPACED_GAP_US = 2000.0
K_PAIRED = ("pddnet_nocma", "pddnet", "raw_ucxx", "nixl")  # rerun in paired 16 MiB rounds
# summary key: (pddnet's row, the peer's row); the ratio is the peer's time over pddnet's
K_PAIRED_RATIOS = {
    "ratio_vs_nixl_16mib": ("pddnet_nocma", "nixl"),  # the receiver as RLD deploys it
    "ratio_vs_raw_ucxx_16mib": ("pddnet_nocma", "raw_ucxx"),
    "ratio_vs_nixl_16mib_cma": ("pddnet", "nixl"),
    "ratio_vs_raw_ucxx_16mib_cma": ("pddnet", "raw_ucxx"),
    "nocma_ratio_16mib": ("pddnet_nocma", "pddnet"),  # without cma over with it
}
K_PAIRED_ITERS = {True: 20, False: 60}  # transfers per paired run (quick, full)
# The cross-host headline: paired 16 MiB rounds in the xhost mode
K_CROSSHOST_PAIRED = ("pddnet", "raw_ucxx", "nixl", "tcp")
K_CROSSHOST_RATIOS = {
    "crosshost_ratio_vs_nixl_16mib": ("pddnet", "nixl"),
    "crosshost_ratio_vs_tcp_16mib": ("pddnet", "tcp"),  # one plain TCP socket
    "crosshost_ratio_vs_raw_ucxx_16mib": ("pddnet", "raw_ucxx"),
}
# Layer by layer (issue 20 item 5): requests of these many layers, each sent as
# one transfer whose layers are marked one by one, against the same request
# sent whole; transfers per layer count (half of each kind, after 2 warm-ups)
K_LAYERS = (32, 80)
K_LAYERWISE_ITERS = {True: 22, False: 62}
K_LAYERWISE_MODES = ("xhost", "sm")  # the headline keys are cross-host
# peer: (the rows that need it, what they import, in --peer-venv (else here), how to get it)
K_PEERS: dict[str, tuple[tuple[str, ...], str, bool, str]] = {
    "ucxx": (
        ("pddnet", "pddnet_poll", "pddnet_nocma", "raw_ucxx", "raw_ucxx_epoll", "layerwise"),
        "ucxx",
        False,
        "install pddnet's ucx extra (pip install -e '.[ucx]': ucxx-cu12)",
    ),
    "nixl": (
        ("nixl", "nixl_notif"),
        "nixl_cu12._api",
        True,
        "rerun with --install-peers (pip installs nixl-cu12 into --peer-venv)",
    ),
    "mooncake": (
        ("mooncake",),
        "mooncake.engine",
        True,
        "rerun with --install-peers (pip installs mooncake-transfer-engine-non-cuda"
        " into --peer-venv)",
    ),
}
_PEER_OF = {row: peer for peer, (rows, *_) in K_PEERS.items() for row in rows}


def _iters(size: int, quick: bool) -> int:
    if size <= 64 << 10:
        return 300 if quick else 1000
    return max(5, int((1e9 if quick else 2e9) // size))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, png=False)
    parser.add_argument("--peer-venv", default=K_PEER_VENV, help="venv holding NIXL / Mooncake")
    parser.add_argument(
        "--install-peers", action="store_true", help="create --peer-venv with pip if missing"
    )
    parser.add_argument("--only", nargs="*", help="implementations to run")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per peer")
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="don't pin the server to CPU 0 and the client to CPU 1",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="paired 16 MiB rounds behind the summary's ratios (default: 11, --quick 7)",
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=None,
        help="transfer sizes of the table in bytes (default: 4 KiB to 256 MiB; --quick: 4 KiB,"
        " 1 MiB, 16 MiB), e.g. --sizes 4096 --rounds 0 for the 4 KiB one-way figures alone",
    )
    parser.add_argument(
        "--poll-us",
        type=float,
        default=K_POLL_US,
        help="busy-poll budget of the pddnet_poll rows (low-latency mode)",
    )


# ------------------------------------------------------------------ children
_COMMON = """
import json, os, sys, time
import numpy as np
SIZES = json.loads(sys.argv[2]); ITERS = json.loads(sys.argv[3])
_CPU = os.environ.get("PDDNET_BENCH_CPU_" + sys.argv[1].upper())
if _CPU:  # --pin: server and client on their own cores (threads they start inherit it)
    os.sched_setaffinity(0, {int(_CPU)})
def out(obj):  # libraries print to stdout too: our lines carry a marker
    sys.stdout.write("@@" + json.dumps(obj) + "\\n"); sys.stdout.flush()
def inp():
    return json.loads(sys.stdin.readline())
def report(size, lat, t0=None, cpu=None):
    a = np.array(lat)
    out({"size": size, "median_s": float(np.median(a)), "p99_s": float(np.percentile(a, 99)),
         "n": len(lat), "t0": t0, "cpu_s": cpu})
def arrived(t1, cpu=None):  # the receiver's completion times (same clock as the sender's)
    out({"t1": t1, "cpu_s": cpu})
def finish(code=0):
    sys.stdout.flush(); sys.stderr.flush(); os._exit(code)
"""

_PDDNET = """
import trio
from pddnet.kv import ByteRanges
from pddnet.transport import Grant
from pddnet.transport.local import UcxReceiver, UcxSender
role = sys.argv[1]
OPTS = {"secret": os.environ["PDDNET_BENCH_SECRET"].encode(),  # authenticated, as deployed
        "busy_poll_us": float(os.environ.get("PDDNET_BENCH_POLL_US", "0")),
        "busy_poll_max_bytes": int(os.environ.get("PDDNET_BENCH_POLL_MAX", str(64 << 10)))}
CMA = os.environ.get("PDDNET_BENCH_CMA", "1") == "1"  # 0: the receiver as RLD makes it
GAP = float(os.environ.get("PDDNET_BENCH_GAP_US", "0")) * 1e-6  # idle between transfers
async def server():
    async with UcxReceiver(**OPTS, cma=CMA) as rx:
        out({"address": rx.address})
        for size in SIZES:
            buf = np.zeros(size, np.uint8)
            r = ByteRanges.build([0], [0], [size], [0])
            n = ITERS[str(size)] + 3
            gs = [rx.grant([buf], r) for _ in range(n)]
            out([[g.transfer_id, g.total, g.address] for g in gs])
            t1 = []
            for g in gs:
                await rx.wait_transfer(g.transfer_id)
                t1.append(time.perf_counter())
                if len(t1) == 3:
                    c0 = time.process_time()
            arrived(t1[3:], (time.process_time() - c0) / (n - 3))
        await trio.to_thread.run_sync(inp)  # the loop runs on: the last DONE still leaves
async def client():
    hello = inp()
    async with UcxSender(hello["address"], **OPTS) as tx:
        for size in SIZES:
            buf = np.ones(size, np.uint8)
            r = ByteRanges.build([0], [0], [size], [0])
            gs = [Grant(t, n, (), a) for t, n, a in inp()]
            lat, t0s = [], []
            for i, g in enumerate(gs):
                if i == 3:
                    c0 = time.process_time()
                t0 = time.perf_counter()
                await tx.send(g, [buf], r)
                if i >= 3:
                    lat.append(time.perf_counter() - t0)
                    t0s.append(t0)
                if GAP:
                    await trio.sleep(GAP)
            report(size, lat, t0s, (time.process_time() - c0) / len(lat))
try:
    trio.run(server if role == "server" else client)
except BaseException:
    import traceback; traceback.print_exc(); finish(1)
finish()
"""

_LAYERWISE = """
import trio
from pddnet.kv import KVLayout, KVPool, block_ranges
from pddnet.transport import Grant
from pddnet.transport.local import UcxReceiver, UcxSender
role = sys.argv[1]
OPTS = {"secret": os.environ["PDDNET_BENCH_SECRET"].encode()}
BLOCKS = int(os.environ.get("PDDNET_BENCH_LW_BLOCKS", "8"))
def pool(layers):  # SIZES are layer counts: a model of that depth, vLLM's K/V-major layout
    lay = KVLayout(num_layers=layers, num_kv_heads=8, head_dim=128, block_size=16, kv_major=True)
    p = KVPool.allocate(lay, 2 * BLOCKS, fill=1 if role == "client" else 0)
    return p, block_ranges(lay, p.num_blocks, list(range(BLOCKS)))
async def server():
    async with UcxReceiver(**OPTS) as rx:
        out({"address": rx.address})
        for layers in SIZES:
            p, r = pool(layers)
            gs = [rx.grant(p.host_views(), r, num_layers=layers) for _ in range(ITERS[str(layers)])]
            out([[g.transfer_id, g.total, list(g.layer_ends), g.address] for g in gs])
            for g in gs:
                await rx.wait_transfer(g.transfer_id)
        await trio.to_thread.run_sync(inp)
async def client():
    hello = inp()
    async with UcxSender(hello["address"], **OPTS) as tx:
        for layers in SIZES:
            p, r = pool(layers)
            views = p.host_views()
            gs = [Grant(t, n, tuple(e), a) for t, n, e, a in inp()]
            lat = {"whole": [], "layerwise": []}
            cpu = {"whole": [], "layerwise": []}  # the sender's CPU per request
            for i, g in enumerate(gs):  # alternating: one whole request, one layer by layer
                layerwise = i % 2 == 1
                c0 = time.process_time()
                t0 = time.perf_counter()
                t = tx.start(g, views, r, ready=not layerwise)
                if layerwise:
                    for layer in range(layers):  # each layer as its own event, no compute gap
                        t.mark_layer_ready(layer)
                        await trio.lowlevel.checkpoint()
                await t.wait()
                if i >= 2:
                    lat["layerwise" if layerwise else "whole"].append(time.perf_counter() - t0)
                    cpu["layerwise" if layerwise else "whole"].append(time.process_time() - c0)
            w, l = np.array(lat["whole"]), np.array(lat["layerwise"])
            out({"size": layers, "median_s": float(np.median(l)), "whole_median_s":
                 float(np.median(w)), "overhead": float(np.median(l / w)), "n": len(l),
                 "bytes": g.total, "cpu_s": float(np.median(cpu["layerwise"])),
                 "whole_cpu_s": float(np.median(cpu["whole"]))})
try:
    trio.run(server if role == "server" else client)
except BaseException:
    import traceback; traceback.print_exc(); finish(1)
finish()
"""

_RAW_UCXX = """
from ucxx._lib import libucxx as ucx
from ucxx._lib.arr import Array
import select
role = sys.argv[1]
BLOCKING = os.environ.get("PDDNET_RAW_BLOCKING") == "1"
feats = (ucx.Feature.TAG, ucx.Feature.WAKEUP) if BLOCKING else (ucx.Feature.TAG,)
ctx = ucx.UCXContext({}, feature_flags=feats)
w = ucx.UCXWorker(ctx)
if BLOCKING:
    w.init_blocking_progress_mode()
    FD = w.epoll_file_descriptor
def wait(req):
    while not req.completed:
        w.progress()
        if BLOCKING and not req.completed and w.arm():
            select.select([FD], [], [], 0.002)  # sleep until UCX has an event
    req.check_error()
def tag(v):
    return ucx.UCXXTag(v)
if role == "server":
    out({"address": bytes(w.address).hex()})
    abuf = np.zeros(4096, np.uint8)
    wait(w.tag_recv(Array(abuf), tag(9)))
    n = int(abuf[:2].view(np.uint16)[0])
    ep = w.create_endpoint_from_worker_address(
        ucx.UCXAddress.create_from_buffer(abuf[2:2 + n].tobytes()), False)
    ack = np.zeros(8, np.uint8)
    for size in SIZES:
        buf = np.zeros(size, np.uint8)
        t1 = []
        for i in range(ITERS[str(size)] + 3):
            wait(w.tag_recv(Array(buf), tag(1)))
            t1.append(time.perf_counter())
            wait(ep.tag_send(Array(ack), tag(2)))
        arrived(t1[3:])
    inp()
else:
    hello = inp()
    ep = w.create_endpoint_from_worker_address(
        ucx.UCXAddress.create_from_buffer(bytes.fromhex(hello["address"])), False)
    mine = bytes(w.address)
    abuf = np.zeros(4096, np.uint8)
    abuf[:2] = np.frombuffer(len(mine).to_bytes(2, "little"), np.uint8)
    abuf[2:2 + len(mine)] = np.frombuffer(mine, np.uint8)
    wait(ep.tag_send(Array(abuf), tag(9)))
    ack = np.zeros(8, np.uint8)
    for size in SIZES:
        buf = np.ones(size, np.uint8)
        lat, t0s = [], []
        for i in range(ITERS[str(size)] + 3):
            t0 = time.perf_counter()
            r = w.tag_recv(Array(ack), tag(2))
            wait(ep.tag_send(Array(buf), tag(1)))
            wait(r)
            if i >= 3:
                lat.append(time.perf_counter() - t0)
                t0s.append(t0)
        report(size, lat, t0s)
finish()
"""

_TCP = """
import socket
role = sys.argv[1]
HOST = os.environ.get("PDDNET_BENCH_HOST", "127.0.0.1")  # xhost: the receiver's address
def recv_exact(s, mv):
    got = 0
    while got < len(mv):
        n = s.recv_into(mv[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n
if role == "server":
    ls = socket.create_server((HOST, 0))
    out({"address": ls.getsockname()[1]})
    s, _ = ls.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for size in SIZES:
        buf = memoryview(bytearray(size))
        t1 = []
        for i in range(ITERS[str(size)] + 3):
            recv_exact(s, buf)
            t1.append(time.perf_counter())
            s.sendall(b"\\0" * 8)
        arrived(t1[3:])
    inp()
else:
    hello = inp()
    s = socket.create_connection((HOST, hello["address"]))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = memoryview(bytearray(8))
    for size in SIZES:
        buf = np.ones(size, np.uint8)
        lat, t0s = [], []
        for i in range(ITERS[str(size)] + 3):
            t0 = time.perf_counter()
            s.sendall(buf)
            recv_exact(s, ack)
            if i >= 3:
                lat.append(time.perf_counter() - t0)
                t0s.append(t0)
        report(size, lat, t0s)
finish()
"""

_NIXL = """
role = sys.argv[1]
from nixl_cu12._api import nixl_agent, nixl_agent_config
name = "rx" if role == "server" else "tx"
# NOTIF: WRITE with a notification; the target busy-polls for it and records
# when it sees it (the receiver-knows time), the initiator leaves a 200 us gap
# after each completion so notifications never queue up.
NOTIF = os.environ.get("PDDNET_NIXL_NOTIF") == "1"
# The initiator polls with its progress thread off (NIXL's threads thrash 2 cores).
cfg = nixl_agent_config(enable_prog_thread=(role == "server" and not NOTIF), backends=["UCX"])
agent = nixl_agent(name, cfg)
big = max(SIZES)
buf = np.zeros(big, np.uint8) if role == "server" else np.ones(big, np.uint8)
reg = agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, big, 0, "")], "DRAM"))
if role == "server":
    out({"meta": agent.get_agent_metadata().hex(), "addr": buf.ctypes.data})
    if NOTIF:
        for size in SIZES:
            t1, want = [], ITERS[str(size)] + 3
            while len(t1) < want:
                for msgs in agent.get_new_notifs().values():
                    now = time.perf_counter()
                    t1.extend([now] * len(msgs))
            arrived(t1[3:])
    inp()
else:
    hello = inp()
    peer = agent.add_remote_agent(bytes.fromhex(hello["meta"]))
    for size in SIZES:
        local = agent.get_xfer_descs([(buf.ctypes.data, size, 0)], "DRAM")
        remote = agent.get_xfer_descs([(hello["addr"], size, 0)], "DRAM")
        h = agent.initialize_xfer("WRITE", local, remote, peer, b"n" if NOTIF else b"")
        lat, t0s = [], []
        for i in range(ITERS[str(size)] + 3):
            t0 = time.perf_counter()
            state = agent.transfer(h)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(h)
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed")
            if i >= 3:
                lat.append(time.perf_counter() - t0)
                t0s.append(t0)
            if NOTIF:
                gap = time.perf_counter() + 200e-6
                while time.perf_counter() < gap:
                    pass
        agent.release_xfer_handle(h)
        report(size, lat, t0s if NOTIF else None)
finish()
"""

_MOONCAKE = """
role = sys.argv[1]
from mooncake.engine import TransferEngine
te = TransferEngine()
rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
if rc != 0:
    raise RuntimeError(f"TransferEngine.initialize returned {rc}")
big = max(SIZES)
buf = np.zeros(big, np.uint8) if role == "server" else np.ones(big, np.uint8)
te.register_memory(buf.ctypes.data, big)
if role == "server":
    out({"peer": f"127.0.0.1:{te.get_rpc_port()}", "addr": buf.ctypes.data})
    inp()
else:
    hello = inp()
    for size in SIZES:
        lat = []
        for i in range(ITERS[str(size)] + 3):
            t0 = time.perf_counter()
            rc = te.transfer_sync_write(hello["peer"], buf.ctypes.data, hello["addr"], size)
            if rc != 0:
                raise RuntimeError(f"transfer_sync_write returned {rc}")
            if i >= 3:
                lat.append(time.perf_counter() - t0)
        report(size, lat)
finish()
"""


def _child_env(tls: str) -> dict[str, str]:
    env = dict(os.environ)
    env["UCX_TLS"] = tls
    env["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    env["PYTHONPATH"] = (
        str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    )
    return env


def run_pair(
    code: str,
    python: str,
    sizes: list[int],
    iters: dict[str, int],
    env: dict[str, str],
    timeout: float,
    *,
    one_way: bool = False,
    spawn: tuple[Any, Any] = (subprocess.Popen, subprocess.Popen),
) -> list[dict[str, Any]]:
    """Run a server and a client child; returns the client's per-size results.

    ``spawn`` starts the server and the client (``Popen``'s signature; the
    testbed's :meth:`~pddnet.emu.Host.spawn` puts them in two namespaces).

    With ``one_way`` the server reports, per size, when each transfer completed
    on its side; ``one_way_s`` is then the median of (receiver completion -
    sender start), both read from ``time.perf_counter`` (CLOCK_MONOTONIC, one
    clock for every process on the host).

    Raises:
        RuntimeError: with the children's stderr if either fails or times out.
    """
    script = textwrap.dedent(_COMMON) + textwrap.dedent(code)
    args = [json.dumps(sizes), json.dumps(iters)]
    popen = dict(
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    srv = spawn[0]([python, "-c", script, "server", *args], **popen)
    cli = spawn[1]([python, "-c", script, "client", *args], **popen)
    deadline = time.monotonic() + timeout
    results: list[dict[str, Any]] = []

    def line(p: Any, who: str) -> str:
        while True:
            text = p.stdout.readline()
            if not text:
                raise RuntimeError(f"{who} failed: {p.stderr.read()[-2000:]}")
            if text.startswith("@@"):
                return str(text[2:])

    try:
        cli.stdin.write(line(srv, "server"))
        cli.stdin.flush()
        for _size in sizes:
            if code is _PDDNET or code is _LAYERWISE:  # the receiver hands out the grants
                cli.stdin.write(line(srv, "server"))
                cli.stdin.flush()
            res = json.loads(line(cli, "client"))
            t0 = res.pop("t0", None)
            if one_way:
                rx = json.loads(line(srv, "server"))
                t1 = rx["t1"]
                if t0 is not None and len(t0) == len(t1):
                    res["one_way_s"] = float(np.median(np.array(t1) - np.array(t0)))
                res["server_cpu_s"] = rx.get("cpu_s")
            results.append(res)
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout} s")
        srv.stdin.write("{}\n")
        srv.stdin.flush()
        cli.wait(timeout=max(1.0, deadline - time.monotonic()))
        srv.wait(timeout=10)
    finally:
        for p in (srv, cli):
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def _install_peers(venv: str, errors: dict[str, str]) -> None:
    """Make the peers' venv: NIXL and Mooncake wheels without their torch/CUDA deps."""
    cmds = [
        [sys.executable, "-m", "venv", venv],
        [f"{venv}/bin/pip", "install", "-q", "--no-deps", "nixl-cu12", "numpy"],
        [f"{venv}/bin/pip", "install", "-q", "--no-deps", "mooncake-transfer-engine-non-cuda"],
    ]
    run_install(cmds, errors)


def missing_peers(peer_venv: str, names: Iterable[str]) -> dict[str, str]:
    """Each peer of :data:`K_PEERS` that the rows ``names`` need and that does
    not import, with how to get it (the summary's ``missing_peers``)."""
    out: dict[str, str] = {}
    wanted = set(names)
    for peer, (rows, module, in_venv, how) in K_PEERS.items():
        if not wanted & set(rows):
            continue
        python = str(Path(peer_venv) / "bin" / "python") if in_venv else sys.executable
        if not Path(python).exists():
            out[peer] = f"no peer environment at {peer_venv}; {how}"
            continue
        try:
            r = subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=120)
            why = (r.stderr.decode(errors="replace").strip().splitlines() or [""])[-1]
            failed = r.returncode != 0
        except subprocess.TimeoutExpired:
            failed, why = True, "timed out after 120 s"
        if failed:
            out[peer] = f"import {module} failed in {python} ({why[:200]}); {how}"
    return out


class _Hosts:
    """The cross-host rows' two hosts: the testbed's dc-a-p and dc-a-rld (their
    DC-A link, a veth each on one bridge, is not shaped), built on first use
    and torn down with ``stack``; or why there are none (a string)."""

    def __init__(self) -> None:
        self._testbed: Testbed | str | None = None

    def __call__(self, stack: contextlib.ExitStack) -> Testbed | str:
        if self._testbed is None:
            self._testbed = unavailable_reason() or stack.enter_context(emulated_wan("1ms"))
        return self._testbed


def _paired_rounds(
    run: Any,
    args: argparse.Namespace,
    size: int,
    rows: tuple[str, ...] = K_PAIRED,
    ratios: dict[str, tuple[str, str]] = K_PAIRED_RATIOS,
    mode: str = "sm",
) -> dict[str, list[float | None]]:
    """Median µs per ``size`` transfer of each row of ``rows`` (in ``mode``), per round.

    Each round runs them back to back in fresh processes, the order rotating,
    so each ratio compares runs seconds apart rather than minutes. A run that
    failed is None (``run`` records its error under the round's name). Empty
    when no pair of ``ratios`` has both rows to run.
    """
    names = [n for n in rows if not args.only or n in args.only]
    rounds = args.rounds if args.rounds is not None else (7 if args.quick else 11)
    if rounds <= 0 or not any(a in names and b in names for a, b in ratios.values()):
        return {}
    n = K_PAIRED_ITERS[bool(args.quick)]
    out: dict[str, list[float | None]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            res = run(name, mode, [size], {str(size): n}, f" paired round {r + 1}")
            out[name].append(res[0]["median_s"] * 1e6 if res else None)
        print(
            f"paired 16 MiB {mode} round {r + 1}/{rounds}: "
            + ", ".join(
                f"{k} {'failed' if v[-1] is None else f'{v[-1]:.0f} µs'}" for k, v in out.items()
            ),
            file=sys.stderr,
        )
    return out


def paired_ratios(
    paired: dict[str, list[float | None]],
    ratios: dict[str, tuple[str, str]] = K_PAIRED_RATIOS,
) -> dict[str, Any]:
    """The summary's paired ratios from :func:`_paired_rounds`' times.

    Returns:
        for each key of ``ratios``: the median of the per-round
        ratios (None if no round has one), ``<key>_rounds`` (each round's
        ratio, None where a side failed; empty if a side was not run), and
        ``failed_rounds``: ``{key: rounds without a ratio}``.
    """
    out: dict[str, Any] = {}
    failed: dict[str, int] = {}
    for key, (base, peer) in ratios.items():
        pairs = zip(paired.get(base, []), paired.get(peer, []), strict=False)
        rounds = [b / a if a and b else None for a, b in pairs]
        ok = [x for x in rounds if x is not None]
        out[key] = float(np.median(ok)) if ok else None
        out[f"{key}_rounds"] = rounds
        failed[key] = len(rounds) - len(ok)
    out["failed_rounds"] = failed
    return out


def layerwise_summary(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The summary's layer-by-layer keys from each mode's :data:`_LAYERWISE` results.

    ``layerwise_overhead_L`` (cross-host) and ``layerwise_overhead_L_sm``
    (same host) are the median over alternating pairs of (layer-by-layer
    time / whole-request time), None where the mode did not run;
    ``layerwise_us`` holds each mode's medians, with the sender's CPU time
    per request (``layerwise_cpu_us``, ``whole_cpu_us``) where the child
    reported it.
    """
    out: dict[str, Any] = {}
    detail: dict[str, dict[str, dict[str, float]]] = {}
    for mode in K_LAYERWISE_MODES:
        got = {int(r["size"]): r for r in results.get(mode, [])}
        suffix = "" if mode == "xhost" else f"_{mode}"
        for layers in K_LAYERS:
            r = got.get(layers)
            out[f"layerwise_overhead_{layers}{suffix}"] = None if r is None else r["overhead"]
            if r is not None:
                detail.setdefault(mode, {})[str(layers)] = {
                    "layerwise_us": r["median_s"] * 1e6,
                    "whole_us": r["whole_median_s"] * 1e6,
                    "mib": r["bytes"] / (1 << 20),
                    "pairs": r["n"],
                }
                if "cpu_s" in r:  # the sender's CPU per request (time.process_time)
                    detail[mode][str(layers)]["layerwise_cpu_us"] = r["cpu_s"] * 1e6
                    detail[mode][str(layers)]["whole_cpu_us"] = r["whole_cpu_s"] * 1e6
    out["layerwise_us"] = detail
    return out


def main(args: argparse.Namespace) -> int:
    """Run the table and the paired rounds (same host, then cross-host); write the summary."""
    with contextlib.ExitStack() as stack:
        return _main(args, stack)


def _main(args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    sizes = args.sizes or (K_QUICK_SIZES if args.quick else K_SIZES)
    iters = {str(s): _iters(s, args.quick) for s in sizes}
    errors: dict[str, str] = {}
    peer_py = str(Path(args.peer_venv) / "bin" / "python")
    if args.install_peers and not Path(peer_py).exists():
        _install_peers(args.peer_venv, errors)
    secret = {"PDDNET_BENCH_SECRET": "bench-local-secret-0123456789"}
    poll = {**secret, "PDDNET_BENCH_POLL_US": str(args.poll_us)}
    spaced = {**secret, "PDDNET_BENCH_GAP_US": str(K_SPACED_GAP_US)}
    # name: (child code, interpreter, modes, extra environment, receiver reports one-way)
    impls: dict[str, tuple[str, str, list[str], dict[str, str], bool]] = {
        "pddnet": (_PDDNET, sys.executable, ["sm", "tcp", "xhost"], secret, True),
        "pddnet_poll": (_PDDNET, sys.executable, ["sm", "tcp", "xhost"], poll, True),
        "pddnet_spaced": (_PDDNET, sys.executable, ["xhost"], spaced, True),
        "pddnet_nocma": (
            _PDDNET,
            sys.executable,
            ["sm"],
            {**secret, "PDDNET_BENCH_CMA": "0"},
            True,
        ),
        "raw_ucxx": (_RAW_UCXX, sys.executable, ["sm", "tcp", "xhost"], {}, True),
        "raw_ucxx_epoll": (_RAW_UCXX, sys.executable, ["sm"], {"PDDNET_RAW_BLOCKING": "1"}, True),
        "tcp": (_TCP, sys.executable, ["tcp", "xhost"], {}, True),
        "nixl": (_NIXL, peer_py, ["sm", "tcp", "xhost"], {}, False),
        "nixl_notif": (_NIXL, peer_py, ["sm", "xhost"], {"PDDNET_NIXL_NOTIF": "1"}, True),
        "mooncake": (_MOONCAKE, peer_py, ["tcp"], {}, False),
        # not a table row: the layer-by-layer pairs after the paired rounds
        "layerwise": (_LAYERWISE, sys.executable, list(K_LAYERWISE_MODES), secret, False),
    }
    # Busy-polling peers (raw ucxx, NIXL, pddnet_poll) collapse when the OS puts
    # both processes on one core (measured: raw ucxx 4 KiB 14 µs -> 7.7 ms), so
    # by default each process gets a core of its own.
    pin = {}
    if not args.no_pin and len(os.sched_getaffinity(0)) >= 2:
        cpus = sorted(os.sched_getaffinity(0))
        pin = {"PDDNET_BENCH_CPU_SERVER": str(cpus[0]), "PDDNET_BENCH_CPU_CLIENT": str(cpus[1])}
    rows: list[dict[str, Any]] = []
    hosts = _Hosts()
    missing = missing_peers(args.peer_venv, [n for n in impls if not args.only or n in args.only])

    def run(
        name: str, mode: str, sizes: list[int], iters: dict[str, int], label: str = ""
    ) -> list[dict[str, Any]]:
        code, python, _modes, extra, one_way = impls[name]
        key = f"{name}/{mode}{label}"
        if _PEER_OF.get(name) in missing:
            errors[key] = missing[_PEER_OF[name]]
            return []
        env = {**_child_env(K_TLS[mode]), **extra, **pin}
        spawn: tuple[Any, Any] = (subprocess.Popen, subprocess.Popen)
        if mode == "xhost":  # the receiver in dc-a-rld, the sender in dc-a-p
            testbed = hosts(stack)
            if isinstance(testbed, str):
                errors[key] = f"no network namespaces here: {testbed}"
                return []
            env["PDDNET_BENCH_HOST"] = testbed.rld.addr
            spawn = (testbed.rld.spawn, testbed.p.spawn)
        try:
            return run_pair(
                code, python, sizes, iters, env, args.timeout, one_way=one_way, spawn=spawn
            )
        except Exception as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
            print(f"{key}: {errors[key][:300]}", file=sys.stderr)
            return []

    for name, (_code, _python, modes, _extra, _one_way) in impls.items():
        if (args.only and name not in args.only) or name == "layerwise":
            continue
        for mode in modes:
            res = run(name, mode, sizes, iters)
            for r in res:
                row = {
                    "impl": name,
                    "mode": mode,
                    "size": r["size"],
                    "median_us": r["median_s"] * 1e6,
                    "gb_per_s": r["size"] / r["median_s"] / 1e9,
                    "n": r["n"],
                }
                if "one_way_s" in r:
                    row["one_way_us"] = r["one_way_s"] * 1e6
                if r.get("cpu_s") is not None:  # CPU time per transfer (pddnet rows)
                    row["cpu_us"] = r["cpu_s"] * 1e6
                    row["server_cpu_us"] = (r.get("server_cpu_s") or 0.0) * 1e6
                rows.append(row)
    print_table(rows, title="local path, two processes (median)")
    print_missing(missing)
    mib16 = 16 << 20
    paired = _paired_rounds(run, args, mib16)
    xpaired = _paired_rounds(run, args, mib16, K_CROSSHOST_PAIRED, K_CROSSHOST_RATIOS, "xhost")
    xratios = paired_ratios(xpaired, K_CROSSHOST_RATIOS)
    xratios["crosshost_failed_rounds"] = xratios.pop("failed_rounds")
    x_us = [t for t in xpaired.get("pddnet", []) if t]
    layerwise: dict[str, list[dict[str, Any]]] = {}
    if not args.only or "layerwise" in args.only:
        n = K_LAYERWISE_ITERS[bool(args.quick)]
        for mode in K_LAYERWISE_MODES:
            layerwise[mode] = run("layerwise", mode, list(K_LAYERS), {str(k): n for k in K_LAYERS})

    def pick(impl: str, mode: str, size: int, field: str) -> float | None:
        for r in rows:
            if (r["impl"], r["mode"], r["size"]) == (impl, mode, size):
                return float(r[field])
        return None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a / b

    summary: dict[str, Any] = {
        # The headline: two hosts without shared memory (the testbed's dc-a-p ->
        # dc-a-rld, UCX_TLS=tcp,self for every UCX user), medians of paired
        # rounds; throughput ratio = the peer's time per 16 MiB over pddnet's.
        **xratios,
        "crosshost_gb_per_s_16mib": mib16 / float(np.median(x_us)) / 1e3 if x_us else None,
        "crosshost_paired_16mib_us": xpaired,
        "crosshost_single_pass_gb_per_s_16mib": {
            name: pick(name, "xhost", mib16, "gb_per_s") for name in K_CROSSHOST_PAIRED
        },
        # 4 KiB, cross-host, sender start -> the receiver knows: pddnet's default
        # mode against NIXL WRITE + notification, same run
        "one_way_ratio_vs_nixl_notif_4kib": ratio(
            pick("pddnet", "xhost", 4096, "one_way_us"),
            pick("nixl_notif", "xhost", 4096, "one_way_us"),
        ),
        "crosshost_one_way_4kib_us": {
            name: pick(name, "xhost", 4096, "one_way_us")
            for name in ("pddnet", "pddnet_poll", "pddnet_spaced", "raw_ucxx", "tcp", "nixl_notif")
        },
        # CPU per 4 KiB transfer [sender, receiver], cross-host: back to back
        # (both ends linger awake) and spaced (each transfer after an idle gap)
        "crosshost_cpu_us_per_4kib_transfer": {
            name: [pick(name, "xhost", 4096, "cpu_us"), pick(name, "xhost", 4096, "server_cpu_us")]
            for name in ("pddnet", "pddnet_spaced")
        },
        # A request of L layers sent layer by layer (one transfer, each layer
        # marked as its own event) over the same request sent whole: median of
        # alternating pairs, cross-host (same host: ..._sm)
        **layerwise_summary(layerwise),
        # Same host (shared memory), medians of paired rounds (see the module's
        # docstring). These use the receiver as RLD deploys it (no cma).
        **paired_ratios(paired),
        "paired_16mib_us": paired,
        "ratio_vs_raw_ucxx_16mib_single_pass": ratio(
            pick("pddnet_nocma", "sm", mib16, "gb_per_s"),
            pick("raw_ucxx", "sm", mib16, "gb_per_s"),
        ),
        "ratio_vs_nixl_16mib_single_pass": ratio(
            pick("pddnet_nocma", "sm", mib16, "gb_per_s"), pick("nixl", "sm", mib16, "gb_per_s")
        ),
        "latency_ratio_vs_nixl_4kib": ratio(
            pick("pddnet", "sm", 4096, "median_us"), pick("nixl", "sm", 4096, "median_us")
        ),
        "pddnet_16mib_gb_per_s": pick("pddnet", "sm", mib16, "gb_per_s"),
        "pddnet_nocma_16mib_gb_per_s": pick("pddnet_nocma", "sm", mib16, "gb_per_s"),
        "pddnet_4kib_median_us": pick("pddnet", "sm", 4096, "median_us"),
        # 4 KiB, like with like (see docs/local.md). Sender-side time: pddnet
        # and raw ucxx until the receiver's confirmation came back (a round
        # trip), NIXL until its one-sided WRITE completed (no notification).
        "pddnet_poll_4kib_median_us": pick("pddnet_poll", "sm", 4096, "median_us"),
        "raw_ucxx_4kib_median_us": pick("raw_ucxx", "sm", 4096, "median_us"),
        "nixl_4kib_median_us": pick("nixl", "sm", 4096, "median_us"),
        "latency_ratio_vs_nixl_4kib_poll": ratio(
            pick("pddnet_poll", "sm", 4096, "median_us"), pick("nixl", "sm", 4096, "median_us")
        ),
        "latency_ratio_vs_raw_ucxx_4kib": ratio(
            pick("pddnet", "sm", 4096, "median_us"), pick("raw_ucxx", "sm", 4096, "median_us")
        ),
        "latency_ratio_vs_raw_ucxx_4kib_poll": ratio(
            pick("pddnet_poll", "sm", 4096, "median_us"),
            pick("raw_ucxx", "sm", 4096, "median_us"),
        ),
        "raw_ucxx_latency_ratio_vs_nixl_4kib": ratio(
            pick("raw_ucxx", "sm", 4096, "median_us"), pick("nixl", "sm", 4096, "median_us")
        ),
        # Receiver-side time (sender start -> the receiver knows the data landed):
        # pddnet's wait_transfer, raw ucxx's receive, NIXL WRITE + notification.
        "one_way_4kib_us": {
            name: pick(name, "sm", 4096, "one_way_us")
            for name in ("pddnet", "pddnet_poll", "raw_ucxx", "raw_ucxx_epoll", "nixl_notif")
        },
        "cpu_us_per_4kib_transfer": {
            name: [pick(name, "sm", 4096, "cpu_us"), pick(name, "sm", 4096, "server_cpu_us")]
            for name in ("pddnet", "pddnet_poll")
        },
        "one_way_ratio_vs_nixl_notif_4kib_poll": ratio(
            pick("pddnet_poll", "sm", 4096, "one_way_us"),
            pick("nixl_notif", "sm", 4096, "one_way_us"),
        ),
        "poll_us": args.poll_us,
        "pinned_cpus": (
            {
                "server": int(pin["PDDNET_BENCH_CPU_SERVER"]),
                "client": int(pin["PDDNET_BENCH_CPU_CLIENT"]),
            }
            if pin
            else None
        ),
        "tcp_16mib_gb_per_s": pick("tcp", "tcp", mib16, "gb_per_s"),
        "targets": {
            "crosshost_ratio_vs_nixl_16mib": ">= 1.0",
            "crosshost_ratio_vs_tcp_16mib": ">= 1.0",
            "one_way_ratio_vs_nixl_notif_4kib": "<= 2.0",
            "layerwise_overhead_32": "<= 1.2",
            "ratio_vs_nixl_16mib": ">= 1.0",
            "ratio_vs_raw_ucxx_16mib": ">= 0.9",
            "latency_ratio_vs_nixl_4kib": "<= 1.5",
        },
    }
    if missing:
        summary["missing_peers"] = missing
    if summary["ratio_vs_nixl_16mib"] is None:
        summary["nixl_error"] = errors.get("nixl/sm", "not run")
    write_report(args.json, summary, rows=rows, errors=errors, iterations=iters)
    return 0
