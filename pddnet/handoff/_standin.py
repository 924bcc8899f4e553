"""A deterministic stand-in engine for driver tests and demos.

Greedy decoding of a pretend model whose next token is a hash of everything
before it (a running BLAKE2b state per position): any two instances agree on
the sequence, an instance that skipped or repeated a token diverges at once,
and ``extend`` must be fed exactly the tokens a single instance would have
produced for the continuation to match. Use it until the reference model is
available; swap in real ``decode_step`` / ``extend`` hooks later.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import trio

from .._errors import LocalProtocolError
from ..wire import Message
from ._events import AbortReason, FinishReason
from ._metrics import RequestMetrics
from ._params import HandoffParams

__all__ = ["StandInEngine", "greedy_reference", "simulate_pair"]

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

    Args:
        step_s: simulated time of one decode step.
        extend_rate: simulated recompute speed, tokens/s.
        max_tokens: requests finish with MAX_TOKENS at this many tokens.
        on_emit: called with (request_id, position, token) for every emit.
    """

    def __init__(
        self,
        *,
        step_s: float = 0.02,
        extend_rate: float = 5000.0,
        max_tokens: int = 256,
        on_emit: Callable[[int, int, int], None] | None = None,
    ) -> None:
        self.step_s = step_s
        self.extend_rate = extend_rate
        self.max_tokens = max_tokens
        self.on_emit = on_emit
        self._state: dict[int, tuple[bytes, int]] = {}  # request -> (state, tokens in KV)
        self.emitted: dict[int, list[tuple[int, int]]] = {}
        self.steps = 0
        self.extended = 0

    def start(self, request_id: int, prompt_seed: int) -> None:
        """The prompt's KV is in place (prefilled, or landed over the WAN)."""
        self._state[request_id] = (_prompt_state(prompt_seed), 0)

    def held(self, request_id: int) -> int:
        """How many output tokens the engine holds KV for."""
        return self._state[request_id][1]

    async def decode_step(self, request_id: int) -> tuple[int, FinishReason | None]:
        """Generate the next token greedily (and hold its KV)."""
        await trio.sleep(self.step_s)
        state, n = self._state[request_id]
        tok = _token_of(state)
        self._state[request_id] = (_next_state(state, tok), n + 1)
        self.steps += 1
        return tok, FinishReason.MAX_TOKENS if n + 1 >= self.max_tokens else None

    async def extend(self, request_id: int, start: int, tokens: Sequence[int]) -> None:
        """Recompute KV for ``tokens`` in one pass.

        Raises:
            LocalProtocolError: if ``start`` is not where the engine's KV ends.
        """
        state, n = self._state[request_id]
        if start != n:
            raise LocalProtocolError(
                f"extend at {start}, but KV ends at {n}", request_id=request_id
            )
        await trio.sleep(len(tokens) / self.extend_rate)
        for tok in tokens:
            state = _next_state(state, int(tok))
        self._state[request_id] = (state, n + len(tokens))
        self.extended += len(tokens)

    async def emit(self, request_id: int, position: int, token: int) -> None:
        """Record the emit (and pass it on)."""
        await trio.lowlevel.checkpoint()
        self.emitted.setdefault(request_id, []).append((position, token))
        if self.on_emit is not None:
            self.on_emit(request_id, position, token)


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

    rld_eng = StandInEngine(step_s=rld_step_s, max_tokens=max_tokens)
    md_eng = StandInEngine(step_s=md_step_s, max_tokens=max_tokens, extend_rate=extend_rate)
    rld_eng.start(request_id, prompt_seed)
    async with trio.open_nursery() as nursery:
        to_md, to_rld = _MemLink(nursery, rtt_s / 2), _MemLink(nursery, rtt_s / 2)
        rld = RelayDriver(rld_eng, to_md, request_id, params)
        md = MainDriver(md_eng, to_rld, request_id, params)
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
