"""A deterministic stand-in engine for driver tests and demos.

Greedy decoding of a pretend model whose next token is a hash of everything
before it (a running BLAKE2b state per position): any two instances agree on
the sequence, an instance that skipped or repeated a token diverges at once,
and ``extend`` must be fed exactly the tokens a single instance would have
produced for the continuation to match. Use it until the reference model is
available; swap in a real engine later.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import trio

from .._errors import LocalProtocolError
from ..wire import Message
from ._driver import HandoffRequest
from ._engine import DecodeRequest, TokenCallback
from ._events import AbortReason, FinishReason
from ._metrics import RequestMetrics
from ._params import HandoffParams

__all__ = ["StandInEngine", "greedy_reference", "simulate_pair", "standin_request"]

K_VOCAB = 1 << 17  # a 128K vocabulary: 17-bit token ids


def _next_state(state: bytes, token: int) -> bytes:
    return hashlib.blake2b(state + token.to_bytes(4, "little"), digest_size=16).digest()


def _token_of(state: bytes) -> int:
    return int.from_bytes(state[:4], "little") % K_VOCAB


def _prompt_state(prompt_seed: int) -> bytes:
    return hashlib.blake2b(prompt_seed.to_bytes(8, "little"), digest_size=16).digest()


def greedy_reference(prompt_seed: int, n: int) -> list[int]:
    """What a single instance decodes greedily for ``n`` tokens."""
    state, out = _prompt_state(prompt_seed), []
    for _ in range(n):
        tok = _token_of(state)
        out.append(tok)
        state = _next_state(state, tok)
    return out


class StandInEngine:
    """One decode instance (RLD or MD) running the stand-in model.

    Implements :class:`~pddnet.handoff.DecodeEngine` (without KV blocks: the
    "KV" is the hash state, recomputed from the tokens), and records the
    tokens a driver emits (a :class:`~pddnet.handoff.TokenOut`). A request's
    ``tokens`` start with the prompt seed.

    Args:
        step_s: simulated time of one decode step.
        extend_rate: simulated recompute speed, tokens/s.
        on_emit: called with (request_id, position, token) for every emit.
    """

    eos_token_id: int | None = None

    def __init__(
        self,
        *,
        step_s: float = 0.02,
        extend_rate: float = 5000.0,
        on_emit: Callable[[int, int, int], None] | None = None,
    ) -> None:
        self.step_s = step_s
        self.extend_rate = extend_rate
        self.on_emit = on_emit
        self._kv: dict[int, int] = {}  # request -> leading tokens whose "KV" it holds
        self._own: dict[int, tuple[int, int]] = {}  # request -> (index, token) it generated last
        self._stopped: set[int] = set()
        self.emitted: dict[int, list[tuple[int, int]]] = {}
        self.steps = 0
        self.extended = 0  # tokens recomputed that this instance did not generate
        self.runs: list[tuple[int, int, int]] = []  # (request, len(tokens), kv_tokens) per run

    def start(self, request_id: int, prompt_seed: int) -> None:
        """The prompt's KV is in place (prefilled, or landed over the WAN)."""
        del prompt_seed  # the seed is tokens[0] of every run
        self._kv[request_id] = 1

    def allocate(self, num_blocks: int) -> Sequence[int]:
        return list(range(num_blocks))

    def free(self, block_ids: Sequence[int]) -> None:
        pass

    def free_blocks(self) -> int:
        return 1 << 30

    async def run(self, request: DecodeRequest, on_token: TokenCallback) -> None:
        """Continue the request (see :meth:`DecodeEngine.run`).

        Raises:
            LocalProtocolError: if ``kv_tokens`` claims KV this instance never computed.
        """
        rid, toks, kv = request.request_id, request.tokens, request.kv_tokens
        if not 0 < kv < len(toks) or kv > self._kv.get(rid, 0):
            raise LocalProtocolError(
                f"continue {len(toks)} tokens with KV for {kv}, but it holds"
                f" {self._kv.get(rid, 0)}",
                request_id=rid,
            )
        self._stopped.discard(rid)
        self.runs.append((rid, len(toks), kv))
        fresh = toks[kv:]
        if len(fresh) == 1 and self._own.get(rid) == (kv, fresh[0]):
            await trio.sleep(self.step_s)  # its own last token: one decode step
        else:
            self.extended += len(fresh)
            await trio.sleep(len(fresh) / self.extend_rate)
        state = _prompt_state(toks[0])
        for tok in toks[1:]:
            state = _next_state(state, tok)
        n = len(toks)
        for made in range(request.max_new_tokens):
            if made:
                await trio.sleep(self.step_s)
            if rid in self._stopped:
                return
            tok = _token_of(state)
            state = _next_state(state, tok)
            self._kv[rid] = n
            self._own[rid] = (n, tok)
            n += 1
            self.steps += 1
            last = made + 1 == request.max_new_tokens
            on_token(tok, FinishReason.MAX_TOKENS if last else None)

    def stop(self, request_id: int) -> None:
        self._stopped.add(request_id)

    async def emit(self, request_id: int, position: int, token: int, final: bool) -> None:
        """Record the emit (and pass it on)."""
        await trio.lowlevel.checkpoint()
        self.emitted.setdefault(request_id, []).append((position, token))
        if self.on_emit is not None:
            self.on_emit(request_id, position, token)


def standin_request(request_id: int, prompt_seed: int, max_tokens: int) -> HandoffRequest:
    """A driver's request for the stand-in model (P's first token included)."""
    first = greedy_reference(prompt_seed, 1)[0]
    return HandoffRequest(request_id, (prompt_seed,), (), max_tokens, first)


class _MemLink:
    """An in-memory link with a one-way delay (for :func:`simulate_pair`)."""

    def __init__(self, nursery: trio.Nursery, delay_s: float) -> None:
        self.nursery = nursery
        self.delay_s = delay_s
        self.peer: Any = None
        self.cancelled = 0

    async def send(self, message: Message) -> None:
        self.nursery.start_soon(self._later, message)

    async def _later(self, message: Message) -> None:
        await trio.sleep(self.delay_s)
        self.peer.deliver(message)

    async def cancel_transfer(self, request_id: int, reason: AbortReason) -> None:
        self.cancelled += 1

    async def free_blocks(self, request_id: int) -> None:
        pass


async def simulate_pair(
    params: HandoffParams,
    *,
    kv_after_s: float,
    max_tokens: int,
    rld_step_s: float = 0.025,
    md_step_s: float = 0.025,
    extend_rate: float = 2000.0,
    rtt_s: float = 0.03,
    request_id: int = 1,
    prompt_seed: int = 1,
) -> tuple[RequestMetrics, list[int]]:
    """Run an RLD and an MD driver over in-memory links with the stand-in engine.

    Meant for a virtual clock (``trio.run(..., clock=MockClock(autojump_threshold=0))``):
    the numbers are the protocol's own timing under the given engine speeds,
    not a measurement of any hardware.

    Returns:
        The request's metrics and the user's stream (checked to be the greedy
        reference: each position once, in order).

    Raises:
        AssertionError: if the stream is not the reference (a protocol bug).
    """
    from ._driver import MainDriver, RelayDriver
    from ._metrics import combine_metrics

    rld_eng = StandInEngine(step_s=rld_step_s)
    md_eng = StandInEngine(step_s=md_step_s, extend_rate=extend_rate)
    rld_eng.start(request_id, prompt_seed)
    req = standin_request(request_id, prompt_seed, max_tokens)
    async with trio.open_nursery() as nursery:
        to_md, to_rld = _MemLink(nursery, rtt_s / 2), _MemLink(nursery, rtt_s / 2)
        rld = RelayDriver(rld_eng, to_md, rld_eng, req, params)
        md = MainDriver(md_eng, to_rld, md_eng, req, params)
        to_md.peer, to_rld.peer = md, rld

        async def wan() -> None:
            await trio.sleep(kv_after_s)
            if not md.machine.done:
                md_eng.start(request_id, prompt_seed)
                md.kv_landed()

        nursery.start_soon(wan)
        async with trio.open_nursery() as sides:
            sides.start_soon(rld.run)
            sides.start_soon(md.run)
        nursery.cancel_scope.cancel()
    now = trio.current_time()
    emits = sorted(e for eng in (rld_eng, md_eng) for e in eng.emitted.get(request_id, []))
    stream = [t for _, t in emits]
    assert [p for p, _ in emits] == list(range(len(emits)))
    assert stream == greedy_reference(prompt_seed, max_tokens)
    return combine_metrics(rld.machine.statistics(now), md.machine.statistics(now)), stream
