"""The bulk streams' unsent mark: high while only bulk runs, low while urgent transfers do."""

from __future__ import annotations

import socket

import trio

from pddnet.transport.testing import make_case
from pddnet.transport.wan import WanReceiver, WanSender
from pddnet.transport.wan._sender import K_DEFAULT_NOTSENT_LOWAT
from pddnet.transport.wan._sockopts import K_TCP_NOTSENT_LOWAT


def test_unsent_mark_policy_with_explicit_times() -> None:
    from pddnet.transport.wan._pacer import UnsentMark

    m = UnsentMark(256 << 10, 1 << 20, hold=0.2)
    assert m.update(0.0, urgent=False) == 1 << 20  # bulk alone: high
    assert m.update(1.0, urgent=True) == 256 << 10  # urgent arrives: low at once
    assert m.update(1.5, urgent=True) == 256 << 10  # still running
    assert m.update(2.0, urgent=False) == 256 << 10  # ended at 2.0: held low
    assert m.update(2.19, urgent=False) == 256 << 10
    assert m.update(2.2, urgent=False) == 1 << 20  # hold over
    assert m.update(2.3, urgent=True) == 256 << 10  # the next one: low again
    assert m.update(2.35, urgent=False) == 256 << 10
    assert m.update(2.45, urgent=True) == 256 << 10  # a train keeps it low
    assert m.update(2.5, urgent=False) == 256 << 10
    assert m.update(2.69, urgent=False) == 256 << 10  # hold counts from the last end
    assert m.update(2.7, urgent=False) == 1 << 20
    assert UnsentMark(0, 1 << 20, hold=0.2).update(0.0, urgent=False) == 0  # no mark: none
    assert UnsentMark(2 << 20, 1 << 20, hold=0.2).update(0.0, urgent=False) == 2 << 20


def _marks(tx: WanSender) -> list[int]:
    return [int(s.sock.getsockopt(socket.IPPROTO_TCP, K_TCP_NOTSENT_LOWAT)) for s in tx._streams]


async def test_bulk_mark_rises_while_only_bulk_runs_and_falls_for_urgent() -> None:
    # a fixed chunk size: no fast path, which would raise the mark anyway
    case = make_case(11, 64 << 10, pieces=1)
    async with (
        WanReceiver() as rx,
        WanSender(rx.address, streams=2, chunk_size=256 << 10) as tx,
    ):
        await tx.wait_connected()
        low = K_DEFAULT_NOTSENT_LOWAT
        bulk, express = _marks(tx)[:2], _marks(tx)[2]
        assert min(bulk) > low, bulk  # no urgent transfer: the bulk streams' mark is high
        assert express == low  # the express stream keeps the configured mark
        grant = rx.grant(case.dst, case.dst_ranges)
        t = tx.start(grant, case.src, case.src_ranges, priority=1, ready=False)
        # set in start(), before any stream task runs and could pull the urgent chunk
        assert _marks(tx) == [low] * 3
        t.mark_ready(0, grant.total)
        with trio.fail_after(10):
            await t.wait()
            await rx.wait_transfer(grant.transfer_id)
        case.check_complete()
        assert _marks(tx) == [low] * 3  # held low just after the urgent transfer ended
        with trio.fail_after(5):
            while min(_marks(tx)[:2]) == low:  # rises once the hold is over
                await trio.sleep(0.02)
        assert _marks(tx)[:2] == bulk and _marks(tx)[2] == low
