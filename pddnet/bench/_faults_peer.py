"""The processes of ``pddnet bench faults``: ``python -m pddnet.bench._faults_peer ROLE CFG``.

``prefill`` hosts the rendezvous and plays P and the user: it submits a
continuous stream of random prompts (random route) for ``duration_s``, each
with a deadline, records every token the sink receives and how each request
ended (in a journal file the orchestrator reads, so the records outlive a
killed P), then drains, waits for its lease table to empty and probes both
decoders' block accounting. ``relay`` and ``main`` run the decode endpoints
with the reference engine and answer :class:`FaultProbe` with their block
counts. Every role prints one ``ready``/``running`` line; the orchestrator
(:mod:`pddnet.bench.faults`) injects faults from outside. The shared secret
comes from ``$PDDNET_SECRET``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import sys
import time
from typing import Any, TextIO

import msgpack
import trio

from .._errors import PddnetError
from ..api import (
    BlocksReleased,
    MainEndpoint,
    PrefillEndpoint,
    ReferenceEngine,
    RelayEndpoint,
    Rendezvous,
    new_request_id,
)
from ..control import ControlNode
from ..handoff import HandoffParams
from ..recompute import TINY, ReferenceModel, greedy
from ..route import Route
from ..wire import Message, message

__all__ = ["FaultProbe", "FaultProbeReply", "probe", "rss_kb"]


@message(80)
class FaultProbe(Message):
    """Ask a decoder of the fault bench for its block accounting."""

    nonce: int = 0


@message(81)
class FaultProbeReply(Message):
    """msgpack ``{"free_blocks", "cache_blocks", "active", "num_blocks"}``."""

    payload: bytes


async def decoder(role: str, cfg: dict[str, Any]) -> None:
    model = ReferenceModel.create(TINY, num_blocks=cfg["blocks"])
    cls = RelayEndpoint if role == "relay" else MainEndpoint
    other = "main" if role == "relay" else "relay"
    # the decoders' own waits follow the request deadline (defaults: 30 s, 10 s)
    params = HandoffParams(
        rtt_s=cfg["rtt_s"],
        recompute_rate=20000.0,
        kv_timeout_s=cfg["transfer_timeout_s"],
        idle_timeout_s=min(10.0, cfg["transfer_timeout_s"] / 2),
    )
    async with cls(
        role,
        model.pool,
        ReferenceEngine(model, step_time_s=cfg["step_time_s"]),
        engine_id=role,
        control_bind=cfg["control"][role],
        data_host=cfg["hosts"][role],
        params=params,
        lease_s=cfg["lease_s"],
    ) as ep:

        def on_probe(peer: str, msg: FaultProbe) -> FaultProbeReply:
            cache = getattr(ep, "cache", None)
            doc = {
                "rss_kb": rss_kb(),
                "free_blocks": _free(model),
                "cache_blocks": len(cache) if cache is not None else 0,
                "active": ep.statistics().active,
                "num_blocks": cfg["blocks"],
            }
            return FaultProbeReply(bytes(msgpack.packb(doc)))

        ep.node.route(FaultProbe, on_probe)
        await Rendezvous.join(ep, "p", cfg["control"]["prefill"], ("p", other))
        print(f"{role}: ready", flush=True)
        await trio.sleep_forever()


async def probe(node: ControlNode, peer: str, timeout: float = 2.0) -> dict[str, Any] | None:
    """A decoder's block accounting, or None if it does not answer."""
    try:
        reply = await node.request(peer, FaultProbe(), timeout=timeout)
    except PddnetError:
        return None
    if not isinstance(reply, FaultProbeReply):
        return None
    doc: dict[str, Any] = msgpack.unpackb(reply.payload)
    return doc


def rss_kb(pid: int | str = "self") -> int:
    """Resident set size of a process in KiB (0 if unknown)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _free(model: ReferenceModel) -> int:
    assert model.allocator is not None
    return int(model.allocator.free_blocks)


def _leaked(doc: dict[str, Any] | None) -> int | None:
    if doc is None:
        return None
    return int(doc["num_blocks"] - doc["free_blocks"] - doc["cache_blocks"])


async def settle_decoders(node: ControlNode, timeout: float) -> dict[str, dict[str, Any] | None]:
    """Probe RLD and MD until neither has active requests nor leaked blocks,
    or ``timeout``; returns the last answers (None: unreachable)."""
    last: dict[str, dict[str, Any] | None] = {}
    deadline = trio.current_time() + timeout
    while True:
        for peer in ("relay", "main"):
            last[peer] = await probe(node, peer)
        settled = all(d is None or (d["active"] == 0 and _leaked(d) == 0) for d in last.values())
        if settled or trio.current_time() > deadline:
            return last
        await trio.sleep(0.2)


# How long after a request's deadline the user keeps waiting for the sink to
# end its stream; past it the request counts as hung (the sink failed to act).
K_HANG_GRACE_S = 1.0


class _Front:
    """The user's side: each request's outcome and P's block releases.

    Every record also goes to the journal (``cfg["journal"]``, one JSON line
    per change, flushed at once), a file outside P: when P is killed the
    orchestrator still reads which requests were submitted and how far each got.
    """

    def __init__(self, journal: TextIO) -> None:
        self.released: dict[int, trio.Event] = {}
        self.release_error: dict[int, tuple[float, str]] = {}  # (when, error)
        self._journal = journal

    def record(self, rec: dict[str, Any]) -> None:
        """Journal ``rec`` (a request's latest line wins)."""
        self._journal.write(json.dumps(rec) + "\n")
        self._journal.flush()  # one write(2): the line survives a SIGKILL of P


async def _worker(
    p: PrefillEndpoint,
    model: ReferenceModel,
    front: _Front,
    rng: random.Random,
    cfg: dict[str, Any],
    stop_at: float,
) -> None:
    names = {"auto": None, "p-md": Route.P_MD, "p-rld-md": Route.P_RLD_MD}
    routes = [names[r] for r in cfg["routes"]]
    deadline_s = cfg["request_timeout_s"]
    while trio.current_time() < stop_at:
        rid = new_request_id()
        prompt = [rng.randrange(TINY.vocab_size) for _ in range(rng.randrange(20, 120))]
        max_tokens = rng.randrange(8, cfg["max_tokens"] + 1)
        route = rng.choice(routes)
        rec: dict[str, Any] = {
            "request_id": rid,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "route": route.value if route else "auto",
            "tokens": [],
            "outcome": None,
            "error": None,
            "t0": time.time(),
        }
        front.record(rec)
        front.released[rid] = trio.Event()
        seq = model.new_sequence()
        model.reserve(seq, len(prompt))
        first = greedy(model.prefill(seq, prompt))
        t_dead = trio.current_time() + deadline_s
        # the user reads the stream through P's token sink: complete and in
        # order, or a typed error by the deadline
        stream = p.sink.open(rid, deadline_s=deadline_s, max_tokens=max_tokens)
        try:
            await p.submit(
                rid,
                prompt,
                seq.block_table.tolist(),
                first,
                max_tokens,
                sink="p",
                route=route,
                deadline_s=deadline_s,
            )
        except PddnetError as exc:
            stream.close(f"submit failed: {exc}")
            front.released[rid].set()  # nothing was leased
        with trio.move_on_at(t_dead + K_HANG_GRACE_S), contextlib.suppress(PddnetError):
            await stream.result()  # its error is recorded below
        rec["tokens"] = [[t.position, t.token] for t in stream.received]
        if stream.done:
            err = stream.error
            rec["outcome"] = "finished" if err is None else "error"
            if err is not None:
                rec["error"] = f"{type(err).__name__}: {err}"
        else:
            rec["outcome"] = "hung"
            # did P's engine at least get a typed error for it in time?
            perr = front.release_error.get(rid)
            if perr is not None and perr[0] <= t_dead:
                rec["error_at_p"] = perr[1]
        rec["elapsed_s"] = time.time() - rec["t0"]
        front.record(rec)
        # the source blocks stay with pddnet until BlocksReleased
        with trio.move_on_after(cfg["lease_s"] + 5.0):
            await front.released[rid].wait()
        rec["released"] = front.released[rid].is_set()
        front.record(rec)
        if rec["released"]:
            model.release(seq)


async def prefill(cfg: dict[str, Any]) -> None:
    model = ReferenceModel.create(TINY, num_blocks=cfg["blocks"])
    with open(cfg["journal"], "a") as journal:
        await _prefill(cfg, model, _Front(journal))


async def _prefill(cfg: dict[str, Any], model: ReferenceModel, front: _Front) -> None:
    async with PrefillEndpoint(
        "p",
        model.pool,
        engine_id="p",
        control_bind=cfg["control"]["prefill"],
        wan_options={"streams": 2},
        lease_s=cfg["lease_s"],
        timeout=cfg["transfer_timeout_s"],
    ) as p:
        directory = Rendezvous.serve(p.node)
        directory.publish(p.info())
        for engine_id in ("relay", "main"):
            info = await directory.wait_for(engine_id, 0, timeout=60)
            await p.connect_peer(info)
        await trio.sleep(0.5)  # let the decoders finish connecting to each other
        baseline = _free(model)
        start = {peer: await probe(p.node, peer) for peer in ("relay", "main")}
        rss0 = rss_kb()
        print("p: running", flush=True)
        async with trio.open_nursery() as nursery:

            async def releases() -> None:
                while True:
                    ev: BlocksReleased = await p.next_event()
                    if ev.error is not None:
                        front.release_error[ev.request_id] = (
                            trio.current_time(),
                            f"{type(ev.error).__name__}: {ev.error}",
                        )
                    front.released.setdefault(ev.request_id, trio.Event()).set()

            rss_samples: list[dict[str, Any]] = []

            async def sample_rss() -> None:
                """Resident memory of the three roles over time (long-lived runs)."""
                t0 = trio.current_time()
                while True:
                    row: dict[str, Any] = {"t": trio.current_time() - t0, "prefill": rss_kb()}
                    for peer in ("relay", "main"):
                        doc = await probe(p.node, peer)
                        row[peer] = doc["rss_kb"] if doc is not None else None
                    rss_samples.append(row)
                    await trio.sleep(cfg["rss_every_s"])

            nursery.start_soon(releases)
            if cfg.get("rss_every_s"):
                nursery.start_soon(sample_rss)
            stop_at = trio.current_time() + cfg["duration_s"]
            async with trio.open_nursery() as workers:
                for i in range(cfg["concurrency"]):
                    rng = random.Random(cfg["seed"] * 1000 + i)
                    workers.start_soon(_worker, p, model, front, rng, cfg, stop_at)
            with trio.move_on_after(cfg["lease_s"] + 5.0):
                while p.statistics().held_blocks:
                    await trio.sleep(0.05)
            decoders = await settle_decoders(p.node, cfg["settle_s"])
            out = {
                "sink": dataclasses.asdict(p.sink.statistics()),
                "p": {
                    "held_blocks": p.statistics().held_blocks,
                    "free_blocks": _free(model),
                    "baseline_free_blocks": baseline,
                    "rss_growth_kb": rss_kb() - rss0,
                },
                "decoders": decoders,
                "decoders_start": start,
                "rss_samples": rss_samples,
            }
            with open(cfg["out"], "w") as f:
                json.dump(out, f)
            print("p: done", flush=True)
            nursery.cancel_scope.cancel()


async def prober(cfg: dict[str, Any]) -> None:
    """After P was killed: settle and report the decoders' accounting."""
    async with ControlNode("probe", secret=None, bind="tcp://127.0.0.1:0") as node:
        for peer in ("relay", "main"):
            await node.connect(peer, cfg["control"][peer])
        decoders = await settle_decoders(node, cfg["settle_s"])
    with open(cfg["out"], "w") as f:
        json.dump({"p": None, "decoders": decoders}, f)


def main() -> None:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    if role == "prefill":
        trio.run(prefill, cfg)
    elif role == "probe":
        trio.run(prober, cfg)
    else:
        trio.run(decoder, role, cfg)


if __name__ == "__main__":
    main()
