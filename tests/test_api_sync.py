"""SyncEndpoint: submit never waits for the loop, every ticket completes once,
events reach poll() from real requests, and close() never lets the loop thread
write into a descriptor it no longer owns."""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Any

import pytest
import trio

import pddnet.api
from pddnet import LocalProtocolError
from pddnet.api import (
    BlocksReleased,
    Completion,
    MainEndpoint,
    PrefillEndpoint,
    ReferenceEngine,
    Submission,
    SyncEndpoint,
)
from pddnet.recompute import TINY, ReferenceModel, greedy
from pddnet.route import Route

KEY = b"a-sync-facade-secret-0123456789abcdef"
NB = 256


def prefill_endpoint() -> SyncEndpoint:
    pm = ReferenceModel.create(TINY, num_blocks=NB)
    return SyncEndpoint(lambda: PrefillEndpoint("p", pm.pool, secret=KEY))


def collect(ep: SyncEndpoint, done: Any, timeout: float = 20.0) -> list[Completion]:
    """poll() (sleeping on the wake-up fd) until ``done(completions)``."""
    got: list[Completion] = []
    end = time.monotonic() + timeout
    while not done(got):
        assert time.monotonic() < end, f"only {got} after {timeout}s"
        select.select([ep.wakeup_fd], [], [], 0.1)
        got += ep.poll()
    return got


def test_completion_is_exported() -> None:
    assert "Completion" in pddnet.api.__all__ and pddnet.api.Completion is Completion


def test_submit_does_not_wait_for_a_held_loop() -> None:
    """A hook holds the endpoint's loop (a blocking call on its thread): submit
    still returns at once, and the call runs when the loop is free again."""
    holding, release, held_done = threading.Event(), threading.Event(), threading.Event()

    async def hold(endpoint: Any) -> str:
        holding.set()
        release.wait(3.0)  # blocks the loop thread, as a slow engine hook would
        held_done.set()
        return "held"

    async def after(endpoint: Any) -> str:
        await trio.lowlevel.checkpoint()
        return "after"

    ep = prefill_endpoint().start()
    try:
        t_hold = ep.submit(hold)
        assert holding.wait(10)
        t0 = time.monotonic()
        t_after = ep.submit(after)
        took = time.monotonic() - t0
        # submit returned while the loop was still held (the old submit waited
        # for the loop: it came back only after hold's 3 s wait ran out)
        assert not held_done.is_set(), f"submit waited {took:.2f}s for the loop"
        release.set()
        got = collect(ep, lambda g: len(g) == 2)
    finally:
        release.set()
        ep.close()
    assert [(c.ticket, c.result, c.error) for c in got] == [
        (t_hold, "held", None),
        (t_after, "after", None),
    ]


def test_every_ticket_completes_even_when_closed_first() -> None:
    """A call still running at close() and one that never ran both complete
    with a LocalProtocolError; after close, submit refuses."""
    started = threading.Event()

    async def forever(endpoint: Any) -> None:
        started.set()
        await trio.sleep_forever()

    ep = prefill_endpoint().start()
    t1 = ep.submit(forever)
    assert started.wait(10)
    ep.close()
    got = ep.poll()
    assert [c.ticket for c in got] == [t1]
    assert isinstance(got[0].error, LocalProtocolError) and "closed" in str(got[0].error)
    with pytest.raises(LocalProtocolError, match="not running"):
        ep.submit(forever)
    ep.close()  # again: a no-op


def test_close_while_a_call_completes_writes_nothing_into_a_reused_fd() -> None:
    """close() gives up waiting for the thread while a (shielded) call is still
    running; the call completes afterwards. Its wake-up write must not reach a
    pipe the program opened since (the old close() closed both ends, so the
    write went into whatever reused the number), and the thread must end cleanly."""
    started = threading.Event()

    async def slow(endpoint: Any) -> str:
        started.set()
        with trio.CancelScope(shield=True):
            await trio.sleep(0.5)
        return "late"

    ep = prefill_endpoint().start()
    ticket = ep.submit(slow)
    assert started.wait(10)
    ep.close(timeout=0.01)  # the shielded call holds the thread for 0.5 s
    r, w = os.pipe()  # the lowest free descriptors: reused numbers, if any were freed
    try:
        thread = ep._thread
        assert thread is not None
        thread.join(20)
        assert not thread.is_alive()
        assert ep._error is None  # no EBADF, no crash on the loop thread
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 16)  # nothing landed in the new pipe
    finally:
        os.close(r)
        os.close(w)
    got = ep.poll()
    assert [(c.ticket, c.result) for c in got] == [(ticket, "late")]


def test_events_and_results_reach_poll_from_real_requests() -> None:
    """P and MD each on a SyncEndpoint (two threads, two trio loops, real
    sockets): submit two requests from the 'engine' thread and collect their
    Submissions (by ticket) and BlocksReleased events (ticket None) via poll()."""
    pm, mm = (ReferenceModel.create(TINY, num_blocks=NB) for _ in range(2))
    p = SyncEndpoint(lambda: PrefillEndpoint("p", pm.pool, secret=KEY))
    md = SyncEndpoint(
        lambda: MainEndpoint("md", mm.pool, ReferenceEngine(mm), secret=KEY),
        forward_events=False,
    )
    with p, md:
        p.call("connect_peer", md.endpoint.info())
        md.call("connect_peer", p.endpoint.info())
        tickets, blocks = {}, {}
        for rid in (1, 2):
            prompt = [rid] * (40 * rid)
            seq = pm.new_sequence()
            pm.reserve(seq, len(prompt))
            first = greedy(pm.prefill(seq, prompt))
            blocks[rid] = tuple(seq.block_table.tolist())
            tickets[
                p.submit(
                    "submit", rid, prompt, list(blocks[rid]), first, 6, sink="p", route=Route.P_MD
                )
            ] = rid

        def done(got: list[Completion]) -> bool:
            return (
                sum(c.ticket is None for c in got) == 2
                and sum(c.ticket in tickets for c in got) == 2
            )

        got = collect(p, done)
    assert len(got) == 4
    for c in got:
        assert c.error is None, c.error
        if c.ticket is None:
            assert isinstance(c.result, BlocksReleased) and c.result.error is None
            assert c.result.block_ids == blocks[c.result.request_id]
        else:
            assert isinstance(c.result, Submission)
            assert c.result.request_id == tickets[c.ticket] and c.result.main == "md"
    assert sorted(c.result.request_id for c in got if c.ticket is None) == [1, 2]
