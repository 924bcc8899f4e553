"""A decoder's re-sends to a slow sink never hold up its other control traffic.

Control handlers run one at a time. A re-send waits on the sink's connection,
so it runs in a task of its own: the decoder answers the ``StreamResend`` at
once, and every other message it gets meanwhile is handled without waiting.
"""

from __future__ import annotations

import socket

import numpy as np
import trio

from pddnet.api import (
    Emitted,
    MainEndpoint,
    PrefillEndpoint,
    ReferenceEngine,
    StatsRequest,
    StreamResend,
    StreamStatus,
)
from pddnet.control import ControlNode
from pddnet.recompute import TINY, ReferenceModel, greedy
from pddnet.route import Route

KEY = b"a-resend-test-secret-0123456789abcdef"
N = 12


def _dead_address() -> str:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def test_a_slow_resend_does_not_delay_other_messages() -> None:
    pm, mm = (ReferenceModel.create(TINY, num_blocks=256) for _ in range(2))
    got: list[Emitted] = []
    user = ControlNode("user", secret=KEY)
    user.route(Emitted, lambda peer, msg: got.append(msg))  # collects, never acknowledges
    async with (
        PrefillEndpoint("p", pm.pool, secret=KEY) as p,
        MainEndpoint("md", mm.pool, ReferenceEngine(mm), secret=KEY) as md,
        user,
    ):
        await p.connect_peer(md.info())
        await md.connect_peer(p.info())
        await md.node.connect("user", user.address)
        await user.connect("md", md.info().control)
        prompt = np.random.default_rng(5).integers(0, TINY.vocab_size, 40).tolist()
        seq = pm.new_sequence()
        pm.reserve(seq, len(prompt))
        first = greedy(pm.prefill(seq, prompt))
        await p.submit(1, prompt, seq.block_table.tolist(), first, N, sink="user", route=Route.P_MD)
        with trio.fail_after(20):
            while not any(m.finished for m in got):
                await trio.sleep(0.01)
        assert [m.position for m in got] == list(range(N))

        # MD's path to the sink now leads nowhere: every send to it waits
        md.sink_timeout_s = 10.0
        await md.node.connect("user", _dead_address())
        with trio.fail_after(2):  # before the fix: the answer waited for the sends (10 s)
            status = await user.request("md", StreamResend(1, 0), timeout=15)
        assert isinstance(status, StreamStatus) and (status.first, status.last) == (0, N - 1)
        with trio.fail_after(2):  # and so did everything after it
            await p.node.request("md", StatsRequest(), timeout=15)
        # one re-send per request at a time: asking again starts no second one
        await user.request("md", StreamResend(1, 0), timeout=5)
        assert len(md.kept.resending) == 1
