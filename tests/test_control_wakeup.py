"""A send that fails must not swallow the socket reader's wake-up.

The zmq FD is edge-triggered, and any zmq call on the socket (a send that
fails included) may consume the edge that announced new input. The node's
reader sleeps on the FD, so each sender must re-check ``EVENTS`` after its
call and wake the reader, whether the send went through or not. The
cluster test's stall (tests/test_cluster_processes.py: MD's last tokens of a
stream never read by P, while P's requests to MD still got their replies on
other sockets) came from a failed send: P's sink acknowledged a finished
stream to a dead relay over its ROUTER (EHOSTUNREACH) right after MD's next
tokens had reached that ROUTER, and its reader never woke for them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import trio
import zmq

from pddnet import PeerUnavailable
from pddnet.bench._hostile_control import raw_dealer
from pddnet.control import ControlNode
from pddnet.wire import encode_frame

sys.path.insert(0, str(Path(__file__).parent))
from control_peer import Note

KEY = "a-wake-up-test-secret-0123456789ab"


async def _delivered(got: list[str], text: str, within: float) -> bool:
    with trio.move_on_after(within):
        while text not in got:
            await trio.sleep(0.01)
        return True
    return False


@pytest.mark.parametrize("gone", ["never known", "its two paths closed"])
async def test_a_failed_send_on_the_router_does_not_strand_arrived_frames(gone: str) -> None:
    async with ControlNode("sink", secret=KEY) as sink:
        got: list[str] = []
        sink.route(Note, lambda peer, msg: got.append(msg.text))
        if gone != "never known":
            # the relay reached the sink on two paths, so the sink answers on
            # both routes (the multi-copy send), then died: both routes fail
            async with ControlNode("rld", secret=KEY) as rld:
                await rld.connect("sink", sink.address, paths=2)
                with trio.fail_after(5):
                    while not sink._twin_routes.get("rld"):  # the twin path is up
                        await rld.ping("sink")
                        await trio.sleep(0.01)
            await trio.sleep(0.1)  # the sink's ROUTER has seen both connections end
        raw = raw_dealer(zmq.Context.instance(), sink.address, b"md", key=KEY.encode())
        try:

            def send_raw(text: str) -> None:
                frame = encode_frame(
                    Note(text), key=KEY.encode(), src="md", dst="sink", seq=time.time_ns()
                )
                raw.send(frame)

            send_raw("first")  # the connection is up, and the sink's reader drained it
            assert await _delivered(got, "first", 5.0)
            await trio.sleep(0.1)  # the reader sleeps on the FD again
            send_raw("second")
            # Block the loop (no checkpoint) until zmq has queued "second" on the
            # sink's ROUTER and signalled its FD; then a send that fails touches
            # that socket before the reader runs.
            time.sleep(0.3)
            with pytest.raises(PeerUnavailable):
                await sink.send("rld", Note("ack"), timeout=0.5)
            assert await _delivered(got, "second", 2.0), "the reader never woke for 'second'"
        finally:
            raw.close(0)
