"""P's first token after the KV (``submit(..., first_token=None)``, then
``set_first_token``): real sockets, P, RLD and MD in one trio loop.

The decoders take an offer whose first token follows, wait for P's
``FirstToken`` before decoding from position 0 (a late one, and one that
comes before the KV landed, both give the single-instance greedy stream), and
answer a bogus one with a typed ``RemoteProtocolError``, keeping on serving.
The sync facade starts calls in submission order, so a queued
``set_first_token`` follows its ``submit``.
"""

from __future__ import annotations

import contextlib
import select
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from pddnet import LocalProtocolError, RemoteCallError
from pddnet.api import (
    Abort,
    Emitted,
    MainEndpoint,
    PrefillEndpoint,
    ReferenceEngine,
    RelayEndpoint,
    SyncEndpoint,
)
from pddnet.bench.faults import reference  # single-instance greedy decoding
from pddnet.control import ControlNode
from pddnet.handoff import FirstToken, HandoffParams
from pddnet.recompute import TINY, ReferenceModel, greedy
from pddnet.route import Route

sys.path.insert(0, str(Path(__file__).parent))
from api_wiring import wire
from test_api_endpoints import Sink

KEY = b"a-first-token-test-secret-0123456789ab"
NB = 512
N_TOKENS = 24


def _prompt(seed: int, n: int = 70) -> list[int]:
    return np.random.default_rng(seed).integers(0, TINY.vocab_size, n).tolist()


class _Rig:
    """P, RLD and MD over the reference model, and the user's sink node."""

    def __init__(self, params: HandoffParams | None = None, step_time_s: float = 0.0) -> None:
        self.pm, self.rm, self.mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(3))
        self.params = params
        self.step_time_s = step_time_s
        self.sink = Sink()

    async def __aenter__(self) -> _Rig:
        kw: dict[str, Any] = {"secret": KEY}
        if self.params is not None:
            kw["params"] = self.params
        step = self.step_time_s
        self._stack = contextlib.AsyncExitStack()
        s = await self._stack.__aenter__()
        self.user = await s.enter_async_context(ControlNode("user", secret=KEY))
        self.p = await s.enter_async_context(PrefillEndpoint("p", self.pm.pool, secret=KEY))
        self.rld = await s.enter_async_context(
            RelayEndpoint("rld", self.rm.pool, ReferenceEngine(self.rm, step_time_s=step), **kw)
        )
        self.md = await s.enter_async_context(
            MainEndpoint("md", self.mm.pool, ReferenceEngine(self.mm, step_time_s=step), **kw)
        )
        self.user.route(Emitted, self.sink.on_emit)
        self.user.route(Abort, self.sink.on_abort)
        await wire(self.p, self.rld, self.md, self.user)
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self._stack.__aexit__(*exc)

    def prefill(self, prompt: list[int]) -> tuple[list[int], int]:
        seq = self.pm.new_sequence()
        self.pm.reserve(seq, len(prompt))
        return seq.block_table.tolist(), greedy(self.pm.prefill(seq, prompt))

    def mark_all(self, rid: int) -> None:
        for layer in range(TINY.num_layers):
            self.p.mark_layer_ready(rid, layer)

    async def ended(self, rid: int, timeout: float = 20.0) -> str:
        with trio.fail_after(timeout):
            while rid not in self.sink.ended:
                await trio.sleep(0.01)
        return self.sink.ended[rid]

    def stream(self, rid: int) -> list[int]:
        got = self.sink.tokens.get(rid, {})
        assert sorted(got) == list(range(len(got))), "a position is missing"
        return [got[k][0] for k in range(len(got))]


@pytest.mark.parametrize("route", [Route.P_RLD_MD, Route.P_MD])
async def test_a_late_first_token_and_an_early_one_both_stream_greedy(route: Route) -> None:
    """Late: the KV landed everywhere (P released its blocks) and the decoders
    emitted nothing while they waited; then set_first_token. Early: the first
    token goes out before any layer is ready, so it beats the KV."""
    async with _Rig() as rig:
        p = rig.p
        # late
        prompt = _prompt(1)
        blocks, first = rig.prefill(prompt)
        sub = await p.submit(
            1, prompt, blocks, None, N_TOKENS, sink="user", route=route, ready=False
        )
        assert sub.decision.route is route
        rig.mark_all(1)
        with trio.fail_after(20):
            released = await p.next_event()  # every transfer finished: the KV landed
        assert released.request_id == 1 and released.error is None
        await trio.sleep(0.3)
        assert 1 not in rig.sink.tokens and 1 not in rig.sink.ended  # waiting, not failed
        await p.set_first_token(1, first)
        assert await rig.ended(1) == "finished"
        assert rig.stream(1) == reference(prompt, N_TOKENS)
        # early
        prompt = _prompt(2)
        blocks, first = rig.prefill(prompt)
        await p.submit(2, prompt, blocks, None, N_TOKENS, sink="user", route=route, ready=False)
        await p.set_first_token(2, first)  # no layer is ready: no KV landed yet
        await trio.sleep(0.1)
        assert 2 not in rig.sink.tokens
        rig.mark_all(2)
        assert await rig.ended(2) == "finished"
        assert rig.stream(2) == reference(prompt, N_TOKENS)
        # P's misuse is P's own LocalProtocolError
        with pytest.raises(LocalProtocolError, match="once"):
            await p.set_first_token(2, first)  # given already (and released)
        blocks, first = rig.prefill(_prompt(3))
        await p.submit(3, _prompt(3), blocks, first, N_TOKENS, sink="user", route=route)
        with pytest.raises(LocalProtocolError, match="first_token=None"):
            await p.set_first_token(3, first)  # it came with the offer
        assert await rig.ended(3) == "finished"
        with trio.fail_after(5):
            while rig.rld.statistics().active or rig.md.statistics().active:
                await trio.sleep(0.01)
        assert rig.rld.statistics().free_blocks == NB
        assert rig.md.statistics().free_blocks == NB - len(rig.md.cache)


async def test_a_bogus_first_token_is_a_typed_error_and_the_decoders_survive() -> None:
    """Unknown request, out of range: refused with RemoteProtocolError (P's
    request raises RemoteCallError), the request unharmed. Twice: the request
    fails with RemoteProtocolError (the sink is told). The next request streams."""
    async with _Rig(step_time_s=0.02) as rig:
        p = rig.p
        for dest in ("rld", "md"):
            with pytest.raises(RemoteCallError, match=r"RemoteProtocolError.*unknown request"):
                await p.node.request(dest, FirstToken(404, 7), timeout=5.0)
        prompt = _prompt(4)
        blocks, first = rig.prefill(prompt)
        await p.submit(1, prompt, blocks, None, N_TOKENS, sink="user", route=Route.P_RLD_MD)
        for dest in ("rld", "md"):
            with pytest.raises(RemoteCallError, match=r"RemoteProtocolError.*uint32"):
                await p.node.request(dest, FirstToken(1, 1 << 33), timeout=5.0)
        await p.set_first_token(1, first)  # the refused one did not count
        assert await rig.ended(1) == "finished"
        assert rig.stream(1) == reference(prompt, N_TOKENS)
        # twice, while RLD decodes (20 ms a token): the request fails, typed
        prompt = _prompt(5)
        blocks, first = rig.prefill(prompt)
        await p.submit(2, prompt, blocks, None, N_TOKENS, sink="user", route=Route.P_RLD_MD)
        await p.set_first_token(2, first)
        await p.node.request("rld", FirstToken(2, first), timeout=5.0)
        assert "RemoteProtocolError: P's first token came twice" in await rig.ended(2)
        # the decoders still serve
        prompt = _prompt(6)
        blocks, first = rig.prefill(prompt)
        await p.submit(3, prompt, blocks, None, N_TOKENS, sink="user", route=Route.P_RLD_MD)
        await p.set_first_token(3, first)
        assert await rig.ended(3) == "finished"
        assert rig.stream(3) == reference(prompt, N_TOKENS)


async def test_a_first_token_that_never_comes_fails_the_request_in_time() -> None:
    """The decoders wait ``kv_timeout_s`` for it, then fail the request with
    TransferTimeout (the sink is told); P's abort forgets the request."""
    async with _Rig(params=HandoffParams(kv_timeout_s=1.0)) as rig:
        prompt = _prompt(7)
        blocks, _ = rig.prefill(prompt)
        await rig.p.submit(1, prompt, blocks, None, N_TOKENS, sink="user", route=Route.P_MD)
        t0 = trio.current_time()
        reason = await rig.ended(1, timeout=10.0)
        assert "TransferTimeout" in reason and "first token" in reason, reason
        assert 0.9 <= trio.current_time() - t0 < 5.0
        await rig.p.abort(1)
        with pytest.raises(LocalProtocolError):
            await rig.p.set_first_token(1, 5)  # forgotten: unknown now
        with trio.fail_after(5):
            while rig.md.statistics().active:
                await trio.sleep(0.01)
        assert rig.md.statistics().free_blocks == NB - len(rig.md.cache)


def test_sync_endpoint_starts_calls_in_submission_order() -> None:
    """Calls start in the order submitted (trio alone runs a batch of new
    tasks in either order), so a queued set_first_token finds its submit's
    request: here 5 rounds of 40 calls, queued while the loop is held so they
    start in one batch."""

    class Recorder:
        def __init__(self) -> None:
            self.order: list[int] = []

        async def __aenter__(self) -> Recorder:
            return self

        async def __aexit__(self, *exc: object) -> None:
            pass

    async def record(ep: Recorder, i: int) -> None:
        ep.order.append(i)
        await trio.sleep(0.001)

    held, release = threading.Event(), threading.Event()

    async def hold(ep: Recorder) -> None:
        held.set()
        release.wait()  # blocks the loop: the next calls queue up

    with SyncEndpoint(Recorder) as ep:
        for _ in range(5):
            held.clear()
            release.clear()
            ep.submit(hold)
            assert held.wait(10)
            ep.endpoint.order.clear()
            tickets = [ep.submit(record, i) for i in range(40)]
            release.set()
            done: set[int | None] = set()
            end = time.monotonic() + 10
            while not set(tickets) <= done:
                assert time.monotonic() < end
                select.select([ep.wakeup_fd], [], [], 0.1)
                done |= {c.ticket for c in ep.poll()}
            assert ep.endpoint.order == list(range(40))


async def test_a_first_token_queued_right_after_its_submit_on_the_sync_facade() -> None:
    """SyncEndpoint: submit(first_token=None) and set_first_token queued back
    to back, from another thread, many times: every request streams greedy."""
    rig = _Rig()
    async with (
        ControlNode("user", secret=KEY) as user,
        RelayEndpoint("rld", rig.rm.pool, ReferenceEngine(rig.rm), secret=KEY) as rld,
        MainEndpoint("md", rig.mm.pool, ReferenceEngine(rig.mm), secret=KEY) as md,
    ):
        user.route(Emitted, rig.sink.on_emit)
        user.route(Abort, rig.sink.on_abort)
        for ep in (rld, md):
            await ep.node.connect(user.name, user.address)
        await rld.connect_peer(md.info())
        await md.connect_peer(rld.info())
        sync = SyncEndpoint(lambda: PrefillEndpoint("p", rig.pm.pool, secret=KEY))
        await trio.to_thread.run_sync(sync.start)
        try:
            for dec in (rld, md):
                await trio.to_thread.run_sync(sync.call, "connect_peer", dec.info())
                await dec.connect_peer(sync.endpoint.info())
            prompts = {rid: _prompt(10 + rid, 40) for rid in range(1, 9)}
            tickets: list[int] = []
            for rid, prompt in prompts.items():
                blocks, first = rig.prefill(prompt)
                route = Route.P_RLD_MD if rid % 2 else Route.P_MD
                tickets.append(
                    sync.submit(
                        "submit", rid, prompt, blocks, None, N_TOKENS, sink="user", route=route
                    )
                )
                tickets.append(sync.submit("set_first_token", rid, first))
            completions: list[Any] = []
            with trio.fail_after(30):
                while {c.ticket for c in completions} < set(tickets):
                    await trio.sleep(0.02)
                    completions += sync.poll()
            errors = [c.error for c in completions if c.ticket is not None and c.error]
            assert errors == []
            for rid, prompt in prompts.items():
                assert await rig.ended(rid) == "finished"
                assert rig.stream(rid) == reference(prompt, N_TOKENS)
        finally:
            await trio.to_thread.run_sync(sync.close)
