"""P's token sink end to end: real endpoints over loopback, lost frames, a dead decoder."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from pddnet import PeerUnavailable, RequestAborted
from pddnet.api import (
    Emitted,
    MainEndpoint,
    PrefillEndpoint,
    ReferenceEngine,
    RelayEndpoint,
    TokenStream,
)
from pddnet.bench.faults import reference  # single-instance greedy decoding
from pddnet.recompute import TINY, ReferenceModel, greedy
from pddnet.route import Route
from pddnet.transport.wan import WanReceiver

sys.path.insert(0, str(Path(__file__).parent))
from api_wiring import wire

KEY = b"a-sink-test-secret-0123456789abcdef"
NB = 256


def tcp() -> WanReceiver:
    return WanReceiver(host="127.0.0.1", secret=KEY)  # the local path's TCP form


def drop_emitted(ep: Any, positions: set[int]) -> list[int]:
    """Make ``ep`` lose the first send of the tokens at ``positions`` (as a reset
    connection loses queued frames); returns the positions it dropped."""
    dropped: list[int] = []
    send = ep.node.send

    async def lossy(peer: str, msg: Any, **kw: Any) -> None:
        if isinstance(msg, Emitted) and msg.position in positions:
            positions.discard(msg.position)
            dropped.append(msg.position)
            return
        await send(peer, msg, **kw)

    ep.node.send = lossy
    return dropped


async def submit(
    p: PrefillEndpoint,
    pm: ReferenceModel,
    rid: int,
    prompt: list[int],
    n: int,
    route: Route,
    **kw: Any,
) -> TokenStream:
    stream = p.sink.open(rid, max_tokens=n, **kw)
    seq = pm.new_sequence()
    pm.reserve(seq, len(prompt))
    first = greedy(pm.prefill(seq, prompt))
    sub = await p.submit(
        rid, prompt, seq.block_table.tolist(), first, n, sink="p", route=route, ready=False
    )
    assert stream.sources == [sub.main] + ([sub.relay] if sub.relay else [])
    for layer in range(pm.pool.layout.num_layers):
        p.mark_layer_ready(rid, layer, sub.relay or sub.main)
    if sub.relay:  # MD's KV lands later: RLD emits eager tokens first
        await trio.sleep(0.15)
        for layer in range(pm.pool.layout.num_layers):
            p.mark_layer_ready(rid, layer, sub.main)
    return stream


async def test_lost_tokens_are_resent_and_the_stream_is_exact() -> None:
    pm, rm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(3))
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY) as p,
        RelayEndpoint(
            "rld", rm.pool, ReferenceEngine(rm, step_time_s=0.01), secret=KEY, receiver=tcp()
        ) as rld,
        MainEndpoint("md", mm.pool, ReferenceEngine(mm, step_time_s=0.002), secret=KEY) as md,
    ):
        p.sink.poll_interval_s = 0.3
        await wire(p, rld, md)
        n = 30
        # RLD loses its first token, MD a middle one and the final one (a tail
        # loss nobody would notice without the sink's silence rule)
        lost_rld = drop_emitted(rld, {0})
        lost_md = drop_emitted(md, {n - 8, n - 1})
        prompt = np.random.default_rng(3).integers(0, TINY.vocab_size, 70).tolist()
        stream = await submit(p, pm, 1, prompt, n, Route.P_RLD_MD, deadline_s=20)
        with trio.fail_after(20):
            tokens = await stream.result()
        assert tokens == reference(prompt, n)
        sources = [t.source for t in stream.received]
        assert sources[0] == "rld" and sources[-1] == "md"
        assert [t.position for t in stream.received] == list(range(n))
        assert lost_rld == [0] and sorted(lost_md) == [n - 8, n - 1]
        resent = rld.statistics().tokens_resent + md.statistics().tokens_resent
        assert resent >= 3
        # the sink closes the stream and acknowledges it: both decoders forget it
        with trio.fail_after(5):
            while p.sink.statistics().open or len(rld.kept) or len(md.kept):
                await trio.sleep(0.01)
        assert p.sink.statistics().finished == 1


async def test_a_dead_decoder_fails_the_stream_with_a_typed_error() -> None:
    pm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(2))
    async with PrefillEndpoint("p", pm.pool, secret=KEY) as p:
        p.sink.poll_interval_s = 0.2
        async with trio.open_nursery() as nursery:
            stop = trio.CancelScope()
            started = trio.Event()

            async def run_md() -> None:
                with stop:
                    async with MainEndpoint(
                        "md", mm.pool, ReferenceEngine(mm, step_time_s=0.02), secret=KEY
                    ) as md:
                        await p.connect_peer(md.info())
                        await md.connect_peer(p.info())
                        started.set()
                        await trio.sleep_forever()

            nursery.start_soon(run_md)
            await started.wait()
            prompt = list(range(40))
            stream = await submit(p, pm, 2, prompt, 500, Route.P_MD, deadline_s=60)
            with trio.fail_after(10):
                async for tok in stream:
                    if tok.position == 5:
                        stop.cancel()  # MD dies mid-stream: no Abort, just silence
                        break
                with pytest.raises(PeerUnavailable, match="md: no answer"):
                    await stream.result()
            assert 5 <= len(stream.tokens) < 500
            assert stream.tokens == reference(prompt, len(stream.tokens))


async def test_an_abort_from_a_decoder_ends_the_stream_and_closing_tells_the_decoders() -> None:
    pm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(2))
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY) as p,
        MainEndpoint("md", mm.pool, ReferenceEngine(mm, step_time_s=0.02), secret=KEY) as md,
    ):
        await p.connect_peer(md.info())
        await md.connect_peer(p.info())
        stream = await submit(p, pm, 3, list(range(30)), 500, Route.P_MD)
        with trio.fail_after(10):
            async for tok in stream:
                if tok.position == 3:
                    break
            stream.close("the user went away")  # the sink tells MD, MD stops and says so
            with pytest.raises(RequestAborted, match="went away"):
                await stream.result()
            while md.statistics().active:
                await trio.sleep(0.01)
        assert md.statistics().free_blocks == NB - len(md.cache)


async def test_closing_the_sink_ends_its_open_streams() -> None:
    from pddnet.api import TokenSink
    from pddnet.control import ControlNode

    async with ControlNode("user", secret=KEY) as node:
        async with TokenSink(node) as sink:
            stream = sink.open(9, sources=("md",))
        with trio.fail_after(2), pytest.raises(RequestAborted, match="sink closed"):
            await stream.result()
        assert stream.done
