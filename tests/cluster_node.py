"""The instances of tests/test_cluster_processes.py, one OS process each.

``python tests/cluster_node.py relay|main NAME URL HOST [LEASE_S]``: a
decoder. It binds on ``HOST``, connects to P (found in the etcd directory at
``URL``) and to every decoder of the other role already registered, registers
under a lease of ``LEASE_S`` seconds (default ``TTL``), then follows the
directory: a decoder of the other role that joins, or comes back under its
name with new addresses, is connected. It
answers :class:`~pddnet.bench._faults_peer.FaultProbe` with its block
accounting.

``python tests/cluster_node.py prefill URL HOST``: P. It follows the directory
(:meth:`PrefillEndpoint.follow`) and runs the test's commands, one JSON object
a line on stdin, each answered by one JSON line on stdout (``_Driver``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import msgpack
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pddnet import PddnetError
from pddnet.api import MainEndpoint, PrefillEndpoint, ReferenceEngine, RelayEndpoint
from pddnet.api._sink import TokenStream
from pddnet.bench._faults_peer import FaultProbe, FaultProbeReply, probe
from pddnet.directory import EtcdDirectory, Load, MemberLeft
from pddnet.recompute import TINY, ReferenceModel, greedy
from pddnet.route import LinkEstimate, Route, RoutePolicy, Router
from pddnet.transport.wan import WanReceiver

KEY = b"a-cluster-process-test-secret-0123456789"
CLUSTER = "t-cluster-processes"
NB = 512  # each decoder's pool
NB_P = 4096  # P's: a fresh sequence per request, never freed
TTL = 2  # seconds: every instance's lease
RLD_STEP_S = 0.02  # RLD's decode step: a relay still decodes when it is killed
# TINY's KV is 8 KiB a block: at 100 kB/s (the router's estimate, not the
# real link) a 200-token first turn's 13 blocks take ~1 s, over the 0.5 s
# target (a relay masks it); a later turn's 2-block delta 0.16 s (P->MD).
POLICY = RoutePolicy(ttft_target_s=0.5, md_first_token_s=0.05)
SLOW = LinkEstimate(bandwidth_bytes_s=1e5, rtt_s=0.001)


def _model(blocks: int = NB) -> ReferenceModel:
    return ReferenceModel.create(TINY, num_blocks=blocks)


async def decoder(role: str, name: str, url: str, host: str, lease_s: int = TTL) -> None:
    m = _model()
    kw: dict[str, Any] = {"secret": KEY, "control_bind": f"tcp://{host}:0", "data_host": host}
    ep: RelayEndpoint | MainEndpoint
    if role == "relay":  # TCP on the local path: no UCX set-up across namespaces
        engine = ReferenceEngine(m, step_time_s=RLD_STEP_S)
        receiver = WanReceiver(host=host, secret=KEY)
        ep = RelayEndpoint(name, m.pool, engine, receiver=receiver, **kw)
    else:
        ep = MainEndpoint(name, m.pool, ReferenceEngine(m), **kw)
    other = "main" if role == "relay" else "relay"

    def on_probe(peer: str, msg: FaultProbe) -> FaultProbeReply:
        assert m.allocator is not None
        cache = getattr(ep, "cache", None)
        doc = {
            "free_blocks": int(m.allocator.free_blocks),
            "cache_blocks": len(cache) if cache is not None else 0,
            "active": ep.statistics().active,
            "num_blocks": NB,
            "offers": ep.statistics().offers,
        }
        return FaultProbeReply(bytes(msgpack.packb(doc)))

    async with EtcdDirectory(url, cluster=CLUSTER, ttl=lease_s) as d, ep:
        ep.node.route(FaultProbe, on_probe)
        p = await d.wait_for("prefill", "p")
        await ep.connect_peer(p.info)
        known = {}
        for member in await d.members(other):
            await ep.connect_peer(member.info)
            known[member.name] = member.info
        await d.register(ep.info(), Load(capacity=8, free_blocks=NB))
        async with d.watch(other) as events:  # lists those who joined meanwhile too
            async for ev in events:
                if isinstance(ev, MemberLeft):
                    known.pop(ev.name, None)
                    ep.node.disconnect(ev.name)  # a new incarnation connects itself
                elif known.get(ev.member.name) != ev.member.info:
                    await ep.connect_peer(ev.member.info)
                    known[ev.member.name] = ev.member.info


class _Driver:
    """P's side of the test: each command's name is a method."""

    def __init__(self, p: PrefillEndpoint, pm: ReferenceModel) -> None:
        self.p = p
        self.pm = pm
        self.streams: dict[int, tuple[dict[str, Any], TokenStream]] = {}
        self.sessions: dict[int, tuple[Any, list[int]]] = {}  # session -> (sequence, [length])
        self.released: dict[int, str | None] = {}  # BlocksReleased: request -> error
        self._released_changed = trio.Event()

    async def collect_releases(self) -> None:
        while True:
            ev = await self.p.next_event()
            self.released[ev.request_id] = None if ev.error is None else repr(ev.error)
            self._released_changed.set()
            self._released_changed = trio.Event()

    async def wait(self, present: list[str], absent: list[str], within: float) -> dict[str, Any]:
        """Until P has connected every ``present`` decoder (an MD's cache
        mirror included) and removed every ``absent`` one."""
        p = self.p
        t0 = trio.current_time()
        with trio.fail_after(within):
            while not (
                all(n in p._roles and (p._roles[n] != "main" or n in p.mirrors) for n in present)
                and not any(n in p._roles for n in absent)
            ):
                await trio.sleep(0.01)
        return {"waited_s": trio.current_time() - t0}

    async def _submit(self, spec: dict[str, Any], hold: bool) -> dict[str, Any]:
        rid, prompt, max_tokens = spec["rid"], spec["prompt"], spec["max_tokens"]
        # a session's turns extend one sequence, as the reference does
        if spec["session"] not in self.sessions:
            self.sessions[spec["session"]] = (self.pm.new_sequence(), [0])
        seq, done = self.sessions[spec["session"]]
        self.pm.reserve(seq, len(prompt))
        seq.length = done[0]
        first = greedy(self.pm.extend(seq, prompt[done[0] :]))
        done[0] = len(prompt)
        blocks = seq.block_table[: self.pm.pool.layout.blocks_for_tokens(len(prompt))]
        stream = self.p.sink.open(rid, deadline_s=20, max_tokens=max_tokens)
        sub = await self.p.submit(
            rid,
            prompt,
            blocks.tolist(),
            first,
            max_tokens,
            sink="p",
            relay=spec.get("relay"),
            main=spec.get("main"),
            route=Route[spec["route"]] if spec.get("route") else None,
            ready=not hold,
        )
        info = {
            "rid": rid,
            "main": sub.main,
            "relay": sub.relay,
            "route": sub.decision.route.name,
            "hit": sub.hit_blocks,
        }
        self.streams[rid] = (info, stream)
        return info

    async def result(self, rid: int, timeout: float = 30.0) -> dict[str, Any]:
        """The request's end: its stream's tokens (and their sources) or
        error, and its BlocksReleased."""
        info, stream = self.streams[rid]
        with trio.move_on_after(timeout):
            with contextlib.suppress(PddnetError):
                await stream.result()
            while rid not in self.released:
                await self._released_changed.wait()
        return {
            **info,
            "done": stream.done,
            "tokens": stream.tokens,
            "sources": [t.source for t in stream.received],  # each token's decoder
            "error": None if stream.error is None else repr(stream.error),
            "released": rid in self.released,
            "release_error": self.released.get(rid),
            # the sink's counters so far (rounds, takeovers): a stalled stream's clues
            "sink": dataclasses.asdict(self.p.sink.statistics()),
        }

    async def run(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Submit the requests at once (the router sees them together), then
        wait for each one's end."""
        async with trio.open_nursery() as nursery:
            for spec in requests:
                nursery.start_soon(self._submit, spec, False)
        return [await self.result(spec["rid"]) for spec in requests]

    async def hold(self, request: dict[str, Any], eager: int) -> dict[str, Any]:
        """Submit a P->RLD->MD request whose KV goes to RLD only (MD's is held
        back until ``release``); return once RLD emitted ``eager`` tokens.
        With ``eager`` 0 RLD gets no KV either: the offers are accepted, no
        transfer moved a byte."""
        info = await self._submit(request, hold=True)
        if eager:
            for layer in range(TINY.num_layers):
                self.p.mark_layer_ready(info["rid"], layer, dest=info["relay"])
        stream = self.streams[info["rid"]][1]
        with trio.fail_after(20):
            while sum(t.source == info["relay"] for t in stream.received) < eager:
                await trio.sleep(0.005)
        return info

    async def release(self, rid: int) -> dict[str, Any]:
        """Let the held request's KV go to MD."""
        info = self.streams[rid][0]
        for layer in range(TINY.num_layers):
            self.p.mark_layer_ready(rid, layer, dest=info["main"])
        return {}

    async def stats(self) -> dict[str, Any]:
        """P's view, and each connected decoder's block accounting."""
        p = self.p
        probes = {}
        for name in sorted(p._roles):
            probes[name] = await probe(p.node, name, timeout=5.0)
        router = p.router.statistics()
        return {
            "held_blocks": p.statistics().held_blocks,
            "active_relays": p.router.active_relays,
            "by_relay": router.by_relay,
            "links": sorted(router.links),
            "roles": dict(p._roles),
            "control_peers": sorted(p.node.peers()),
            "probes": probes,
        }

    async def controls(self) -> dict[str, str]:
        """Where P's control connection to each decoder goes."""
        return {n: pump.address for n, pump in self.p.node._dealers.items()}

    async def predict(self, main: str, prompt: list[int]) -> dict[str, Any]:
        """The blocks of ``prompt`` P's mirror of ``main``'s cache holds."""
        from pddnet.cache import block_hashes

        keys = block_hashes(prompt, self.p.pool.layout.block_size)
        return {"blocks": self.p.mirrors[main].predict(keys)}


async def prefill(url: str, host: str) -> None:
    pm = _model(NB_P)
    router = Router(POLICY, SLOW)
    async with (
        EtcdDirectory(url, cluster=CLUSTER, ttl=TTL) as d,
        PrefillEndpoint(
            "p", pm.pool, secret=KEY, router=router, control_bind=f"tcp://{host}:0"
        ) as p,
        trio.open_nursery() as nursery,
    ):
        await d.register(p.info())
        await nursery.start(p.follow, d)
        driver = _Driver(p, pm)
        nursery.start_soon(driver.collect_releases)
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buf = b""
        print(json.dumps({"ready": True}), flush=True)
        while True:
            while b"\n" not in buf:
                chunk = await stdin.receive_some()
                if not chunk:
                    nursery.cancel_scope.cancel()
                    return
                buf += chunk
            line, buf = buf.split(b"\n", 1)
            cmd = json.loads(line)
            op = cmd.pop("op")
            try:
                reply = {"ok": await getattr(driver, op)(**cmd)}
            except Exception as exc:  # the test reports it
                reply = {"error": f"{op}: {type(exc).__name__}: {exc}"}
            print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "prefill":
        trio.run(prefill, sys.argv[2], sys.argv[3])
    else:
        lease_s = int(sys.argv[5]) if len(sys.argv) > 5 else TTL
        trio.run(decoder, sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], lease_s)
