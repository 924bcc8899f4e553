"""Hostile strangers against a ControlNode (issue 19, attack 5): bounded state, few log lines.

Real loopback sockets: each stranger is its own zmq DEALER (its own TCP
connection and routing identity) sending frames that fail authentication or
do not parse, as a stranger without the secret would.
"""

from __future__ import annotations

import logging
import os

import pytest
import trio
import zmq

from pddnet._ratelog import LogLimiter
from pddnet.control import ControlNode
from pddnet.wire import Ping, encode_frame

KEY = b"hostile-control-secret-0123456789"
K_STRANGERS = 1500
K_BATCH = 100
K_BOUND_S = 60.0


def _stranger_frames(ident: bytes) -> list[bytes]:
    """What one stranger sends: a forged frame (wrong key) and garbage."""
    forged = encode_frame(Ping(b"x"), key=b"not-the-secret", src=ident.decode(), dst="md", seq=1)
    return [forged, os.urandom(64)]


async def _flood(address: str, strangers: int) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    for start in range(0, strangers, K_BATCH):
        socks = []
        for i in range(start, min(start + K_BATCH, strangers)):
            s = ctx.socket(zmq.DEALER)
            ident = f"stranger-{i}".encode()
            s.setsockopt(zmq.IDENTITY, ident)
            s.setsockopt(zmq.LINGER, 2000)  # close() still delivers what was queued
            s.connect(address)
            for frame in _stranger_frames(ident):
                s.send(frame)
            socks.append(s)
        await trio.sleep(0.05)  # let the node's reader run between batches
        for s in socks:
            s.close()


def _table_sizes(node: ControlNode) -> dict[str, int]:
    """The size of every dict/set/list the node holds (its per-peer tables among them)."""
    sizes = {}
    for name, value in vars(node).items():
        if isinstance(value, dict | set | list):
            sizes[name] = len(value)
        elif isinstance(value, LogLimiter):
            sizes[f"{name}.last"] = len(value._last)
            sizes[f"{name}.suppressed"] = len(value.suppressed)
    return sizes


async def test_many_stranger_identities_leave_no_state_and_few_log_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pddnet.control")
    async with ControlNode("md", secret=KEY) as md, ControlNode("p0", secret=KEY) as p0:
        await p0.connect("md", md.address)
        assert await p0.ping("md", timeout=5) >= 0  # the honest peer, before
        baseline = _table_sizes(md)
        t0 = trio.current_time()
        with trio.fail_after(K_BOUND_S):
            await _flood(md.address, K_STRANGERS)
            while True:  # every stranger's two frames were read and rejected
                st = md.statistics()
                if st.rejected_auth + st.rejected_malformed >= 2 * K_STRANGERS:
                    break
                await trio.sleep(0.05)
        elapsed = trio.current_time() - t0
        # the honest peer, after: still answered
        assert await p0.ping("md", timeout=5) >= 0
        st = md.statistics()
        assert st.delivered == 2 and st.rejected_replay == 0  # the honest pings, nothing else
        sizes = _table_sizes(md)
    assert st.rejected_auth >= K_STRANGERS  # every forged frame was refused
    # no table grew with the strangers (a per-identity table would hold 1500+)
    grown = {k: (baseline.get(k, 0), v) for k, v in sizes.items() if v > baseline.get(k, 0) + 4}
    assert not grown, f"tables grew with strangers: {grown}"
    lines = [r for r in caplog.records if "dropped" in r.getMessage()]
    # at most one line per reason (auth, malformed) per second of flood, plus the first
    assert len(lines) <= 2 * (int(elapsed) + 2), (len(lines), elapsed)
    suppressed = [r.getMessage() for r in lines if "suppressed" in r.getMessage()]
    assert suppressed or elapsed < 1.0, "a line after the first must say what it suppressed"


def test_log_limiter_counts_what_it_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    logger = logging.getLogger("pddnet.test.ratelog")
    lim = LogLimiter(logger, interval=1.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="pddnet.test.ratelog")
    assert lim.warning("a", "first %d", 1)
    assert not lim.warning("a", "second %d", 2)
    assert not lim.warning("a", "third %d", 3)
    assert lim.warning("b", "other reason")  # reasons are limited separately
    now[0] = 1.5
    assert lim.warning("a", "fourth %d", 4)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [
        "first 1",
        "other reason",
        "fourth 4 (2 more like it suppressed in the last 1.5 s)",
    ]
    assert lim.suppressed == {}
