"""Instances come and go, with a real etcd (tests/etcd_server.py) and MD
processes: P follows the directory (PrefillEndpoint.follow), connects an MD
that joins and sends it traffic, and when an MD process is killed removes it
within the lease's TTL (plus etcd's expiry check), so new requests go to the
other MD; no request is lost and no source block leaks.

The MDs run in child processes: this file, run as a script (see the end)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Any

import numpy as np
import trio

from pddnet import PddnetError
from pddnet.api import MainEndpoint, PrefillEndpoint, ReferenceEngine
from pddnet.directory import EtcdDirectory, Load
from pddnet.recompute import TINY, ReferenceModel, greedy
from pddnet.route import LinkEstimate, Route, RoutePolicy, Router

KEY = b"a-cluster-etcd-test-secret-0123456789ab"
CLUSTER = "t-cluster-etcd"
NB = 512
TTL = 2  # seconds: the lease of each MD process
MAX_TOKENS = 8


def _model() -> ReferenceModel:
    return ReferenceModel.create(TINY, num_blocks=NB)


async def _md_process(url: str, name: str) -> None:
    """An MD: registers with the directory once it reached P, then serves."""
    m = _model()
    async with (
        EtcdDirectory(url, cluster=CLUSTER, ttl=TTL) as d,
        MainEndpoint(name, m.pool, ReferenceEngine(m), secret=KEY) as md,
    ):
        p = await d.wait_for("prefill", "p")
        await md.connect_peer(p.info)
        await d.register(md.info(), Load(capacity=8, free_blocks=NB))
        await trio.sleep_forever()


def _spawn(url: str, name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), url, name])


async def _serve(p: PrefillEndpoint, pm: ReferenceModel, rid: int, prompt: list[int]) -> Any:
    """Prefill, submit, and read the stream whole; the submission."""
    seq = pm.new_sequence()
    pm.reserve(seq, len(prompt))
    first = greedy(pm.extend(seq, prompt))
    stream = p.sink.open(rid, deadline_s=20, max_tokens=MAX_TOKENS)
    sub = await p.submit(rid, prompt, seq.block_table.tolist(), first, MAX_TOKENS, sink="p")
    tokens = await stream.result()
    assert len(tokens) == MAX_TOKENS and tokens[0] == first
    return sub


async def test_an_md_that_joins_gets_traffic_and_one_killed_leaves_within_the_ttl() -> None:
    from etcd_server import start_etcd

    server = start_etcd()
    procs: list[subprocess.Popen[bytes]] = []
    pm = _model()
    rng = np.random.default_rng(21)
    # a fast link estimate: every request goes P->MD (no RLD here)
    router = Router(RoutePolicy(ttft_target_s=5.0), LinkEstimate(1e9, 0.001))
    try:
        async with (
            EtcdDirectory(server.url, cluster=CLUSTER, ttl=TTL) as d,
            PrefillEndpoint("p", pm.pool, secret=KEY, router=router) as p,
            trio.open_nursery() as nursery,
        ):
            await d.register(p.info())
            await nursery.start(p.follow, d)
            with trio.fail_after(60):
                procs.append(_spawn(server.url, "md0"))
                while "md0" not in p.mirrors:  # joined: P connected it
                    await trio.sleep(0.05)
                sub = await _serve(p, pm, 1, rng.integers(0, TINY.vocab_size, 100).tolist())
                assert sub.main == "md0" and sub.decision.route is Route.P_MD
                procs.append(_spawn(server.url, "md1"))
                while "md1" not in p.mirrors:
                    await trio.sleep(0.05)
                # a new MD gets traffic: md0 states a full batch, md1 an empty one
                sub = await _serve(p, pm, 2, rng.integers(0, TINY.vocab_size, 100).tolist())
                p.set_main_load("md0", 8, 8)
                sub = await _serve(p, pm, 3, rng.integers(0, TINY.vocab_size, 100).tolist())
                assert sub.main == "md1"
                p.set_main_load("md0", 0, 8)
                # a request in flight to md0 when it dies (its KV held back)
                seq = pm.new_sequence()
                prompt = rng.integers(0, TINY.vocab_size, 100).tolist()
                pm.reserve(seq, len(prompt))
                first = greedy(pm.extend(seq, prompt))
                lost = p.sink.open(5, deadline_s=20, max_tokens=MAX_TOKENS)
                await p.submit(
                    5,
                    prompt,
                    seq.block_table.tolist(),
                    first,
                    MAX_TOKENS,
                    sink="p",
                    main="md0",
                    ready=False,
                )
                procs[0].send_signal(signal.SIGKILL)
                procs[0].wait()
                killed = trio.current_time()
                while "md0" in p.mirrors:
                    await trio.sleep(0.05)
                left_s = trio.current_time() - killed
                # the lease's TTL, etcd's 0.5 s expiry check, the watch's delivery
                print(f"md0 left P {left_s:.2f} s after its kill")
                assert left_s <= TTL + 1.5, left_s
                assert "md0" not in router.statistics().links
                subs = [
                    await _serve(p, pm, 10 + i, rng.integers(0, TINY.vocab_size, 100).tolist())
                    for i in range(4)
                ]
                assert [s.main for s in subs] == ["md1"] * 4
                # every request's blocks came back, none with an error
                events = p.poll_events()
                while len(events) < 8:
                    events.append(await p.next_event())
                assert sorted(e.request_id for e in events) == [1, 2, 3, 5, 10, 11, 12, 13]
                # the one in flight to md0 ended with its error (the transfer
                # was cancelled when md0 left), the others completed
                assert [e.request_id for e in events if e.error is not None] == [5]
                assert p.statistics().held_blocks == 0
                with trio.move_on_after(15), contextlib.suppress(PddnetError):
                    await lost.result()  # it fails on the sink's timers
                assert lost.done and lost.error is not None
            nursery.cancel_scope.cancel()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.close()


if __name__ == "__main__":
    trio.run(_md_process, sys.argv[1], sys.argv[2])
