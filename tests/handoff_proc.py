"""One side of a handoff in its own OS process (used by test_handoff_processes.py).

    python tests/handoff_proc.py md  --kv-after S --max-tokens N [--engine model]
    python tests/handoff_proc.py rld --md-addr tcp://... --max-tokens N [--engine model]

Prints ``ADDR <endpoint>`` (MD, once bound), one ``EMIT <position> <token>``
line per emitted token, ``CANCEL <reason>`` / ``FREE`` for those hooks, and
``DONE <state> <rounds> <error>`` at the end. The secret comes from
$PDDNET_SECRET. ``--engine standin`` (default) decodes the stand-in model;
``--engine model`` the reference model (pddnet.recompute, TINY, NumPy), whose
MD side recomputes RLD's tokens with a real extend pass.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import numpy as np
import trio

from pddnet import PddnetError
from pddnet.api import ReferenceEngine
from pddnet.control import ControlNode
from pddnet.handoff import (
    AbortReason,
    ControlLink,
    HandoffHub,
    HandoffParams,
    HandoffRequest,
    MainDriver,
    RelayDriver,
    StandInEngine,
    standin_request,
)
from pddnet.recompute import TINY, PagedSequence, ReferenceModel, greedy

RID, SEED = 9001, 1234
WEIGHT_SEED = 11
PROMPT = np.random.default_rng(SEED).integers(0, TINY.vocab_size, 37).tolist()


class ModelEngine(ReferenceEngine):
    """The reference engine over one reference-model instance, with the
    request's blocks, recording the tokens a driver emits (a TokenOut).
    Ticks run on the event loop (the tests use a virtual clock)."""

    def __init__(self, max_tokens: int, step_s: float = 0.02) -> None:
        model = ReferenceModel.create(TINY, num_blocks=64, seed=WEIGHT_SEED)
        super().__init__(model, step_time_s=step_s, worker_thread=False)
        self.max_tokens = max_tokens
        self.table = self.allocate(64)
        self.first = -1
        self.emitted: list[tuple[int, int]] = []
        self.on_emit: Any = None

    def start(self, prompt: Sequence[int]) -> None:
        """The prompt's KV is in place (here: computed locally, as P would)."""
        seq = PagedSequence(np.asarray(self.table, np.int32), 0)
        self.first = greedy(self.model.prefill(seq, list(prompt)))

    def request(self, prompt: Sequence[int]) -> HandoffRequest:
        """The driver's request (P's first token included: call :meth:`start` first)."""
        return HandoffRequest(RID, tuple(prompt), tuple(self.table), self.max_tokens, self.first)

    async def emit(self, request_id: int, position: int, token: int, final: bool) -> None:
        self.emitted.append((position, token))
        if self.on_emit is not None:
            self.on_emit(request_id, position, token)


def reference(prompt: Sequence[int], n: int) -> list[int]:
    model = ReferenceModel.create(TINY, num_blocks=64, seed=WEIGHT_SEED)
    seq = model.new_sequence()
    out = [greedy(model.prefill(seq, list(prompt)))]
    while len(out) < n:
        out.append(greedy(model.decode_step(seq, out[-1])))
    return out


def make_engine(args: argparse.Namespace) -> Any:
    if args.engine == "model":
        eng = ModelEngine(args.max_tokens, step_s=args.step)
        eng.on_emit = lambda r, p, t: out("EMIT", p, t)
        return eng
    return StandInEngine(step_s=args.step, on_emit=lambda r, p, t: out("EMIT", p, t))


def request_for(engine: Any, max_tokens: int) -> HandoffRequest:
    if isinstance(engine, ModelEngine):
        return engine.request(PROMPT)
    return standin_request(RID, SEED, max_tokens)


def start(engine: Any) -> None:
    if isinstance(engine, ModelEngine):
        engine.start(PROMPT)
    else:
        engine.start(RID, SEED)


def out(*parts: object) -> None:
    print(*parts, flush=True)


async def on_cancel(rid: int, reason: AbortReason) -> None:
    out("CANCEL", reason.name)


async def on_free(rid: int) -> None:
    out("FREE")


async def run_md(args: argparse.Namespace) -> None:
    engine = make_engine(args)
    async with ControlNode("md0", bind="tcp://127.0.0.1:0") as node:
        hub = HandoffHub(node)
        link = ControlLink(node, "rld0", on_cancel_transfer=on_cancel, on_free_blocks=on_free)
        driver = MainDriver(
            engine, link, engine, request_for(engine, args.max_tokens), HandoffParams(rtt_s=0.01)
        )
        hub.attach(driver)
        out("ADDR", node.address)

        async def wan() -> None:  # the KV delta crossing the WAN
            while True:  # the request starts when RLD is up and connected
                try:
                    await node.ping("rld0", timeout=0.2)
                    break
                except PddnetError:
                    await trio.sleep(0.05)
            await trio.sleep(args.kv_after)
            start(engine)
            driver.kv_landed()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wan)
            done = await driver.run()
            nursery.cancel_scope.cancel()
        out("DONE", done.state.name, 0, done.error)


async def run_rld(args: argparse.Namespace) -> None:
    engine = make_engine(args)
    start(engine)
    async with ControlNode("rld0", bind="tcp://127.0.0.1:0") as node:
        hub = HandoffHub(node)
        await node.connect("md0", args.md_addr)
        await node.ping("md0", timeout=10.0)  # MD can now route to us
        link = ControlLink(node, "md0", on_cancel_transfer=on_cancel)
        driver = RelayDriver(
            engine, link, engine, request_for(engine, args.max_tokens), HandoffParams(rtt_s=0.01)
        )
        hub.attach(driver)
        done = await driver.run()
        await trio.sleep(0.2)  # let the last frames drain before the sockets close
        out("DONE", done.state.name, driver.machine.rounds, done.error)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["md", "rld"])
    p.add_argument("--md-addr")
    p.add_argument("--kv-after", type=float, default=1.5)
    p.add_argument("--max-tokens", type=int, default=250)
    p.add_argument("--step", type=float, default=0.01)
    p.add_argument("--engine", choices=["standin", "model"], default="standin")
    args = p.parse_args()
    trio.run(run_md if args.role == "md" else run_rld, args)


if __name__ == "__main__":
    main()
