"""The processes of ``pddnet demo --engine vllm``.

Run as ``python -m pddnet.demo._vllm_roles ROLE CONFIG_JSON``.

The same three roles as :mod:`pddnet.demo._roles`, each a vLLM 0.32 CPU
instance over the tiny Llama checkpoint ``cfg["model"]``
(:func:`~pddnet.integrations.vllm.build_tiny_llama`), one OS process per role
(vLLM's worker-side connector is a process-wide singleton):

* ``prefill``: vLLM with P's connector, whose ``kv_connector_extra_config``
  carries the demo's router, link estimate and WAN options. The main thread
  owns vLLM and steps it; the front end (sessions, the user's token streams
  through P's sink) runs on the P endpoint's own trio thread, and asks the
  main thread for each prefill through a queue (a vLLM request with ``max_tokens=1`` whose
  ``kv_transfer_params`` name the pddnet request).
* ``relay`` / ``main``: :class:`~pddnet.integrations.vllm.VllmDecodeEngine`
  behind the demo's RelayEndpoint / MainEndpoint (:func:`~._roles.serve_decoder`).
* ``oracle``: single-instance vLLM greedy decoding of ``cfg["prompts"]``
  (no connector), the reference every demo stream is checked against.

This module imports vLLM; the demo's parent process never imports it.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import trio

from ..api import (
    PrefillEndpoint,
    Rendezvous,
    SyncEndpoint,
    new_request_id,
)
from ..integrations.vllm import (
    VllmDecodeEngine,
    apply_cpu_env,
    cpu_engine_kwargs,
    reference_config,
    run_greedy,
)
from ..route import Route
from ._roles import await_outcome, close_record, new_record, phase_stats, serve_decoder
from ._workload import DemoRequest, make_sessions

# The workload's longest prompts plus their answers fit: the first turn's 1200
# + 512 tokens, the last's 1200 + 3 * 48 + 128; the tiny checkpoint has 2048
# positions.
K_MAX_MODEL_LEN = 2048


def engine_kwargs(model: str, **overrides: Any) -> dict[str, Any]:
    """vLLM's arguments for every role and the oracle: the same model and numerics."""
    return cpu_engine_kwargs(model, max_model_len=K_MAX_MODEL_LEN, **overrides)


# --------------------------------------------------------------------- P
_Prefill = tuple[int, list[int], int, str | None]  # pddnet id, prompt, max_tokens, route


def prefill(cfg: dict[str, Any]) -> None:
    """P: step vLLM on this thread while the front end runs on the endpoint's."""
    apply_cpu_env()
    import vllm
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    kv = KVTransferConfig(
        kv_connector="PrefillKVConnector",
        kv_connector_module_path="pddnet.integrations.vllm.connectors",
        kv_role="kv_producer",
        kv_connector_extra_config={
            "name": "p",
            "control_bind": cfg["control"],
            "router": {
                "ttft_target_s": cfg["ttft_target_s"],
                "rld_decode_rate": 1 / cfg["step_time_s"],
            },
            "link": {"bandwidth_bytes_s": cfg["rate_bps"] / 8, "rtt_s": cfg["rtt_s"]},
            "wan_options": {"streams": 4},
        },
    )
    t_build = time.monotonic()
    engine = vllm.LLMEngine.from_engine_args(
        vllm.EngineArgs(**engine_kwargs(cfg["model"], kv_transfer_config=kv))
    )
    print(f"p: vLLM engine built in {time.monotonic() - t_build:.1f}s", flush=True)
    scheduler = engine.engine_core.engine_core.scheduler
    sync: SyncEndpoint = get_kv_transfer_group().endpoint
    prefills: queue.SimpleQueue[_Prefill | None] = queue.SimpleQueue()
    box: list[Any] = []

    def front() -> None:
        try:
            box.append(sync.call(_frontend, cfg, prefills, timeout=cfg["phase_timeout_s"]))
        except BaseException as exc:  # re-raised on the main thread
            box.append(exc)
        finally:
            prefills.put(None)

    thread = threading.Thread(target=front, name="demo-frontend", daemon=True)
    thread.start()
    front_done = False
    while not front_done or scheduler.has_requests():
        if engine.has_unfinished_requests():
            wait: float | None = 0.0  # prefills to compute: never block
        elif scheduler.has_requests():
            wait = 0.005  # only held blocks: step now and then for the releases
        else:
            wait = None
        for item in _drain(prefills, wait):
            if item is None:
                front_done = True
            else:
                _add_prefill(vllm, engine, item)
        if scheduler.has_requests():
            engine.step()
    thread.join()
    sync.close()
    if isinstance(box[0], BaseException):
        raise box[0]
    with open(cfg["out"], "w") as f:
        json.dump(box[0], f)


def _drain(q: queue.SimpleQueue[Any], wait: float | None) -> list[Any]:
    """Everything in ``q``, waiting up to ``wait`` seconds (None: forever) for the first."""
    out = []
    try:
        out.append(q.get(timeout=wait) if wait != 0.0 else q.get_nowait())
        while True:
            out.append(q.get_nowait())
    except queue.Empty:
        return out


def _add_prefill(vllm: Any, engine: Any, item: _Prefill) -> None:
    rid, prompt, max_tokens, route = item
    pddnet = {"request_id": rid, "max_tokens": max_tokens, "sink": "p", "route": route}
    params = vllm.SamplingParams(
        temperature=0.0,
        max_tokens=1,  # the prefill's token is P's first token
        ignore_eos=True,
        extra_args={"kv_transfer_params": {"pddnet": pddnet}},
    )
    engine.add_request(str(rid), {"prompt_token_ids": prompt}, params)


async def _frontend(
    p: PrefillEndpoint, cfg: dict[str, Any], prefills: queue.SimpleQueue[_Prefill | None]
) -> dict[str, Any]:
    """(P's endpoint thread) rendezvous, run the phase's sessions, collect the stats."""
    directory = Rendezvous.serve(p.node)
    directory.publish(p.info())
    for engine_id in ("relay", "main"):
        info = await directory.wait_for(engine_id, 0, timeout=cfg["join_timeout_s"])
        await p.connect_peer(info)
    await trio.sleep(0.5)  # let the decoders finish connecting to each other
    print("p: connected to relay and main", flush=True)
    phase = cfg["phase"]
    route = Route.P_MD if phase == "baseline" else None
    vocab = reference_config(cfg["model"]).vocab_size
    sessions = [
        [r if r.turn else dataclasses.replace(r, max_tokens=cfg["first_turn_tokens"]) for r in s]
        for s in make_sessions(
            cfg["seed"], cfg["sessions"], cfg["turns"], vocab=vocab, max_tokens=cfg["max_tokens"]
        )
    ]
    records: dict[int, dict[str, Any]] = {}
    t_phase = time.monotonic()
    async with trio.open_nursery() as nursery:
        for reqs in sessions:
            nursery.start_soon(_session, p, prefills, records, phase, reqs, route, cfg)
    print(f"p: phase {phase} done in {time.monotonic() - t_phase:.1f}s", flush=True)
    return {"requests": list(records.values()), "stats": await phase_stats(p)}


async def _session(
    p: PrefillEndpoint,
    prefills: queue.SimpleQueue[_Prefill | None],
    records: dict[int, dict[str, Any]],
    phase: str,
    reqs: list[DemoRequest],
    route: Route | None,
    cfg: dict[str, Any],
) -> None:
    for req in reqs:
        rid = new_request_id()
        rec = new_record(rid, phase, req)
        records[rid] = rec
        t0 = trio.current_time()
        stream = p.sink.open(rid, deadline_s=cfg["request_timeout_s"], max_tokens=req.max_tokens)
        # vLLM prefills it (P's prefix cache: only the new part is computed),
        # then the connector submits it to pddnet
        prefills.put((rid, list(req.prompt), req.max_tokens, route.name if route else None))
        with trio.move_on_after(cfg["request_timeout_s"]):
            await await_outcome(rec, stream)
            while rid in p.leases:  # as the reference demo: the next turn follows the release
                await trio.sleep(0.01)
        decision = next((d for d in p.router.decisions() if d.request_id == rid), None)
        if decision is not None:
            rec.update(route=decision.route.value, reason=decision.reason.name)
        close_record(rec, stream, t0)


# -------------------------------------------------------------- RLD / MD
async def decoder(role: str, cfg: dict[str, Any]) -> None:
    """RLD or MD: vLLM behind the demo's decoder endpoint."""
    async with VllmDecodeEngine(
        cfg["model"],
        staging_blocks=cfg["staging_blocks"],
        engine_kwargs={"max_model_len": K_MAX_MODEL_LEN},
    ) as engine:
        await serve_decoder(role, cfg, engine.pool, engine)


# ---------------------------------------------------------------- oracle
def oracle(cfg: dict[str, Any]) -> None:
    """Single-instance vLLM greedy streams of ``cfg["prompts"]`` (prompt ``i``
    answering ``cfg["max_tokens"][i]`` tokens), written to ``cfg["out"]``."""
    apply_cpu_env()
    import vllm

    engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**engine_kwargs(cfg["model"])))
    steps: dict[str, list[list[int]]] = {}
    for n in sorted(set(cfg["max_tokens"])):  # one batch per answer length
        group = {str(i): p for i, p in enumerate(cfg["prompts"]) if cfg["max_tokens"][i] == n}
        steps.update(run_greedy(engine, group, n))
    streams = [[t for s in steps[str(i)] for t in s] for i in range(len(cfg["prompts"]))]
    with open(cfg["out"], "w") as f:
        json.dump(streams, f)


def main(args: Sequence[str] | None = None) -> None:
    """Run ``ROLE CONFIG_JSON`` (``sys.argv[1:]`` unless ``args`` is given:
    :mod:`~pddnet.demo._zygote` passes them to the processes it forks)."""
    role, config = args if args is not None else sys.argv[1:3]
    cfg = json.loads(config)
    if role == "prefill":
        prefill(cfg)
    elif role == "oracle":
        oracle(cfg)
    else:
        trio.run(decoder, role, cfg)


if __name__ == "__main__":
    main()
