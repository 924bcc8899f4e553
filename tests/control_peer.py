"""A control-plane peer run in its own OS process by test_control.py."""

from __future__ import annotations

import sys

import trio

from pddnet.control import ControlNode
from pddnet.wire import Message, message


@message(13)
class Note(Message):
    """Test-only event: the server records its text."""

    text: str


@message(14)
class Report(Message):
    """Test-only request/reply: what the server delivered and rejected."""

    texts: list[str]
    rejected_auth: int
    rejected_replay: int


async def serve(key: bytes) -> None:
    texts: list[str] = []
    async with ControlNode("server", secret=key) as node:

        async def on_note(peer: str, msg: Note) -> None:
            texts.append(f"{peer}:{msg.text}")

        def on_report(peer: str, msg: Report) -> Report:
            s = node.statistics()
            return Report(list(texts), s.rejected_auth, s.rejected_replay)

        node.route(Note, on_note)
        node.route(Report, on_report)
        print(node.address, flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(serve, sys.argv[1].encode())
