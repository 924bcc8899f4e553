"""A chunk payload still arriving when its transfer ends must stop writing.

When a transfer is cancelled, fails or times out, the engine frees its blocks
and may hand them to another request at once. A stream that was in the middle
of a chunk (a stalled stream under loss, a hedged twin) must not write the rest
of that payload into them: a peer may write only into blocks its transfer was
granted, and only while the grant lives.
"""

from __future__ import annotations

import pytest
import trio
from trio import socket as tsocket

from pddnet import TransferCancelled, TransferTimeout
from pddnet.transport.testing import make_case
from pddnet.transport.wan import WanReceiver
from pddnet.wire import ChecksumAlgo, ChunkHeader, checksum

N = 16384


async def _raw(address: str) -> tsocket.SocketType:
    host, port = address.rsplit(":", 1)
    sock = tsocket.socket()
    await sock.connect((host, int(port)))
    return sock


@pytest.mark.parametrize("end", ["cancel", "timeout"])
async def test_payload_in_flight_stops_writing_when_its_transfer_ends(end: str) -> None:
    case = make_case(12, 20_000, pieces=1)
    async with WanReceiver() as rx:
        grant = rx.grant(case.dst, case.dst_ranges, timeout=0.5 if end == "timeout" else 30.0)
        tid = grant.transfer_id
        sock = await _raw(rx.address)
        payload = bytes([7]) * N
        hdr = ChunkHeader(tid, 0, N, checksum(ChecksumAlgo.CRC32C, payload), ChecksumAlgo.CRC32C)
        await sock.send(hdr.encode() + payload[:4096])  # the stream stalls mid-payload
        pieces = list(case.dst_ranges.pieces(0, N))

        def region_is(value: int) -> bool:
            return all((case.dst[b][o : o + n] == value).all() for b, o, n in pieces)

        with trio.fail_after(5):
            while case.dst[pieces[0][0]][pieces[0][1]] != 7:
                await trio.sleep(0.01)  # the receiver is writing this chunk
        if end == "cancel":
            rx.cancel(tid)
        with trio.fail_after(5), pytest.raises((TransferCancelled, TransferTimeout)):
            await rx.wait_transfer(tid)
        # the blocks go back to the engine, which writes a new request's KV there
        for b, o, n in pieces:
            case.dst[b][o : o + n] = 0x55
        await sock.send(payload[4096:])  # the straggler's payload goes on
        await trio.sleep(0.3)
        assert region_is(0x55), "bytes of an ended transfer landed in the pool"
        case.check_outside_untouched()
        sock.close()
