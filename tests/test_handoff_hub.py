"""The handoff hub over real control nodes (loopback zmq, one process)."""

from __future__ import annotations

import trio

from pddnet.control import ControlNode
from pddnet.handoff import HandoffHub, KvReady, TokenBatch
from pddnet.wire import Message

SECRET = b"hub-test-secret-0123456789abcdef"


class FakeDriver:
    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        self.got: list[Message] = []
        self.failed: list[int | None] = []
        self.event = trio.Event()

    def deliver(self, message: Message) -> None:
        self.got.append(message)
        self.event.set()

    def peer_failed(self, user_position: int | None = None) -> None:
        self.failed.append(user_position)
        self.event.set()


async def test_hub_routes_by_request_and_detects_failure() -> None:
    async with ControlNode("md0", secret=SECRET) as md_node:
        hub = HandoffHub(md_node)
        d1, d2 = FakeDriver(1), FakeDriver(2)
        hub.attach(d1)  # type: ignore[arg-type]
        hub.attach(d2)  # type: ignore[arg-type]
        rld_node = ControlNode("rld0", secret=SECRET)
        async with rld_node:
            await rld_node.connect("md0", md_node.address)
            await rld_node.ping("md0", timeout=5.0)
            await rld_node.send("md0", TokenBatch.build(2, 0, [5, 6, 7], False))
            await rld_node.send("md0", KvReady(99))  # no driver: dropped and counted
            with trio.fail_after(5):
                await d2.event.wait()
            assert d2.got == [TokenBatch.build(2, 0, [5, 6, 7], False)] and d1.got == []
            d2.event = trio.Event()
            with trio.fail_after(5):
                while hub.unrouted < 1:
                    await trio.sleep(0.01)
            # While rld0 answers pings, the watcher reports nothing.
            with trio.move_on_after(0.6):
                await hub.watch("rld0", interval_s=0.1, misses=2)
            assert d1.failed == [] and d2.failed == []
        # rld0 is gone: the watcher declares it failed and tells every driver.
        with trio.fail_after(10):
            await hub.watch("rld0", interval_s=0.2, misses=2, user_position=lambda rid: rid * 10)
        assert d1.failed == [10] and d2.failed == [20]


async def test_hub_holds_messages_for_an_expected_request() -> None:
    async with (
        ControlNode("rld0", secret=SECRET) as rld_node,
        ControlNode("md0", secret=SECRET) as md_node,
    ):
        hub = HandoffHub(rld_node)
        hub.expect(9)
        await md_node.connect("rld0", rld_node.address)
        await md_node.send("rld0", KvReady(9))  # before RLD's driver exists
        await md_node.send("rld0", KvReady(10))  # nobody expects request 10
        with trio.fail_after(5):
            while hub.unrouted < 1:
                await trio.sleep(0.01)
        driver = FakeDriver(9)
        hub.attach(driver)  # type: ignore[arg-type]
        assert driver.got == [KvReady(9)]
        hub.detach(9)
        await md_node.send("rld0", KvReady(9))  # late: dropped, not held
        with trio.fail_after(5):
            while hub.unrouted < 2:
                await trio.sleep(0.01)
        assert driver.got == [KvReady(9)]
