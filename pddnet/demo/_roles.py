"""The demo's three processes: ``python -m pddnet.demo._roles ROLE CONFIG_JSON``.

P hosts the rendezvous and plays the front end: it prefills each prompt with
the reference model, submits it, and reads the user's token stream through P's token sink, with
delivery times and the decoder that produced each token. RLD and MD register with P's
rendezvous, look each other up, and serve. The shared secret comes from
``$PDDNET_SECRET``.

The three processes run one phase (``cfg["phase"]``: ``pdd`` or ``baseline``)
of the workload ``make_sessions(cfg["seed"], ...)``; the demo starts three
fresh processes for each phase, so both phases see the same prompts and start
from the same state: empty caches (MD's radix cache, P's mirror of it) and new
connections.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TypeVar

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
    StatsReply,
    StatsRequest,
    TokenStream,
    new_request_id,
    stats_payload,
)
from ..control import load_secret
from ..handoff import DecodeEngine, HandoffParams
from ..kv import KVPool
from ..recompute import TINY, ReferenceModel, greedy
from ..route import LinkEstimate, Route, RoutePolicy, Router
from ..transport.wan import WanReceiver
from ._workload import DemoRequest, make_sessions

T = TypeVar("T")


async def decoder(role: str, cfg: dict[str, Any]) -> None:
    model = ReferenceModel.create(TINY, num_blocks=cfg["blocks"])
    await serve_decoder(
        role, cfg, model.pool, ReferenceEngine(model, step_time_s=cfg["step_time_s"])
    )


async def serve_decoder(role: str, cfg: dict[str, Any], pool: KVPool, engine: DecodeEngine) -> None:
    """RLD or MD over ``engine`` (landing KV in ``pool``), joined to P's rendezvous."""
    cls = RelayEndpoint if role == "relay" else MainEndpoint
    other = "main" if role == "relay" else "relay"
    params = HandoffParams(
        rtt_s=cfg["rtt_s"],
        recompute_rate=20000.0,
        catchup_threshold=cfg["catchup_threshold"],
        playout_s=cfg.get("playout_s", 0.0),
    )
    # The relay's local path: UCX (RelayEndpoint's default where ucxx imports)
    # unless the demo chose TCP (--local-path tcp, or its UCX probe failed
    # between P's and RLD's hosts: the demo printed why; see _local_path).
    receiver = None
    if role == "relay" and cfg["local_path"] == "tcp":
        receiver = WanReceiver(host=cfg["data_host"], secret=load_secret())
    # Multi-turn sessions: when RLD finishes first, the prompt's KV still goes
    # to MD's cache, because the session's next turn starts with it.
    extra: dict[str, Any] = (
        {"cut_off_wan": False} if role == "relay" else {"keep_strange_traffic": True}
    )
    async with cls(
        role,
        pool,
        engine,
        engine_id=role,
        control_bind=cfg["control"],
        data_host=cfg["data_host"],
        params=params,
        receiver=receiver,
        **extra,
    ) as ep:
        timeout = cfg.get("join_timeout_s", 30.0)
        await Rendezvous.join(ep, "p", cfg["rendezvous"], ("p", other), timeout=timeout)
        print(f"{role}: ready at {ep.info().control}", flush=True)
        await trio.sleep_forever()


class _Frontend:
    """The user's side: each request's record, and P's block releases."""

    def __init__(self) -> None:
        self.records: dict[int, dict[str, Any]] = {}
        self.released: dict[int, trio.Event] = {}


async def prefill(cfg: dict[str, Any]) -> None:
    model = ReferenceModel.create(TINY, num_blocks=cfg["blocks"])
    policy = RoutePolicy(ttft_target_s=cfg["ttft_target_s"], rld_decode_rate=1 / cfg["step_time_s"])
    router = Router(policy, LinkEstimate(cfg["rate_bps"] / 8, cfg["rtt_s"]))
    front = _Frontend()
    async with PrefillEndpoint(
        "p",
        model.pool,
        engine_id="p",
        control_bind=cfg["control"],
        router=router,
        wan_options={"streams": 4},
    ) as p:
        directory = Rendezvous.serve(p.node)
        directory.publish(p.info())
        infos = {}
        for engine_id in ("relay", "main"):
            infos[engine_id] = info = await directory.wait_for(engine_id, 0, timeout=60)
            await p.connect_peer(info)
        await trio.sleep(0.5)  # let the decoders finish connecting to each other
        print("p: connected to relay and main", flush=True)

        async with trio.open_nursery() as nursery:

            async def releases() -> None:
                while True:
                    ev: BlocksReleased = await p.next_event()
                    front.released.setdefault(ev.request_id, trio.Event()).set()

            nursery.start_soon(releases)
            phase = cfg["phase"]
            route = Route.P_MD if phase == "baseline" else None
            sessions = make_sessions(
                cfg["seed"],
                cfg["sessions"],
                cfg["turns"],
                vocab=TINY.vocab_size,
                max_tokens=cfg["max_tokens"],
            )
            t_phase = time.monotonic()
            async with trio.open_nursery() as phase_nursery:
                for reqs in sessions:
                    phase_nursery.start_soon(_session, p, model, front, phase, reqs, route, cfg)
            print(f"p: phase {phase} done in {time.monotonic() - t_phase:.1f}s", flush=True)
            stats = await phase_stats(p)
            # the local path P's sender took: UCX for the relay's ucx: address
            stats["local_path"] = "ucx" if infos["relay"].data.startswith("ucx:") else "tcp"
            results = list(front.records.values())
            with open(cfg["out"], "w") as f:
                json.dump({"requests": results, "stats": stats}, f)
            nursery.cancel_scope.cancel()


async def phase_stats(p: PrefillEndpoint) -> dict[str, Any]:
    """Every role's counters at the end of a phase (the decoders' by request)."""
    stats: dict[str, Any] = {}
    for peer in ("relay", "main"):
        reply = await p.node.request(peer, StatsRequest(), timeout=10)
        assert isinstance(reply, StatsReply)
        stats[peer] = msgpack.unpackb(reply.payload)
    stats["p"] = msgpack.unpackb(stats_payload(p.statistics(), p.router.decisions()))
    return stats


def new_record(rid: int, phase: str, req: DemoRequest) -> dict[str, Any]:
    """The timeline record of one request, before it runs."""
    return {
        "request_id": rid,
        "phase": phase,
        "session": req.session,
        "turn": req.turn,
        "prompt": list(req.prompt),
        "max_tokens": req.max_tokens,
        "tokens": [],
        "outcome": None,
        "t0": time.monotonic(),
    }


async def await_outcome(rec: dict[str, Any], stream: TokenStream) -> None:
    """Wait for the request's whole stream; its outcome goes in ``rec``."""
    try:
        await stream.result()
        rec["outcome"] = "finished"
    except PddnetError as exc:
        rec["outcome"] = f"error: {type(exc).__name__}: {exc}"


def close_record(rec: dict[str, Any], stream: TokenStream, t0: float) -> None:
    """The request is over (or timed out): its tokens and time, and a line of progress."""
    rec["tokens"] = [[t.time - t0, t.position, t.token, t.source] for t in stream.received]
    rec["elapsed_s"] = time.monotonic() - rec["t0"]
    print(
        f"p: [{rec['phase']}] session {rec['session']} turn {rec['turn']}: {rec['outcome']}",
        flush=True,
    )


async def _session(
    p: PrefillEndpoint,
    model: ReferenceModel,
    front: _Frontend,
    phase: str,
    reqs: list[DemoRequest],
    route: Route | None,
    cfg: dict[str, Any],
) -> None:
    seq = model.new_sequence()
    done_len = 0
    for req in reqs:
        rid = new_request_id()
        front.released.setdefault(rid, trio.Event())
        rec = new_record(rid, phase, req)
        t0 = trio.current_time()
        front.records[rid] = rec
        # P's own prefix cache: only the new part of the prompt is prefilled
        model.reserve(seq, len(req.prompt))
        seq.length = done_len
        first = greedy(model.extend(seq, list(req.prompt[done_len:])))
        done_len = len(req.prompt)
        rec["prefill_s"] = time.monotonic() - rec["t0"]
        blocks = seq.block_table[: -(-len(req.prompt) // model.block_size)].tolist()
        # the user's stream, through P's token sink (in order, no holes)
        stream = p.sink.open(rid, deadline_s=cfg["request_timeout_s"], max_tokens=req.max_tokens)
        try:
            sub = await p.submit(
                rid,
                req.prompt,
                blocks,
                first,
                req.max_tokens,
                sink="p",
                route=route,
                deadline_s=cfg["request_timeout_s"],
            )
        except PddnetError as exc:
            stream.close(f"submit failed: {exc}")
            rec["outcome"] = f"error: {exc}"
            continue
        rec.update(
            route=sub.decision.route.value,
            reason=sub.decision.reason.name,
            hit_blocks=sub.hit_blocks,
            blocks=len(blocks),
        )
        with trio.move_on_after(cfg["request_timeout_s"]):
            await await_outcome(rec, stream)
            await front.released[rid].wait()  # the next turn rewrites the shared tail block
        close_record(rec, stream, t0)


def main() -> None:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    if role == "prefill":
        trio.run(prefill, cfg)
    else:
        trio.run(decoder, role, cfg)


if __name__ == "__main__":
    main()
