"""The parts a decode endpoint is composed of, one at a time.

Admission, the requests in progress, the per-request links, the sink-side
emitter and MD's takeover reports, each built on its own: fakes stand in
for the engine, the receiver and the grants (pure logic); messages between
nodes go over real control nodes on loopback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import trio

from pddnet import RemoteProtocolError, ResourceLimitError
from pddnet.api import Emitted, KvOffer, MainEndpoint, ReferenceEngine, StreamTakeover
from pddnet.api._admit import Admission
from pddnet.api._emit import SinkEmitter
from pddnet.api._grants import BlockGrants
from pddnet.api._kept import KeptTokens
from pddnet.api._link import MainLink, RelayLink
from pddnet.api._messages import CutOffWan
from pddnet.api._publish import DrcPublisher
from pddnet.api._record import RequestRecord
from pddnet.api._requests import DecodeRequests
from pddnet.api._stream import SourceState
from pddnet.api._takeover import TakeoverReports
from pddnet.cache import CacheServer, DrcInserted, DrcSnapshot, DrcSnapshotRequest, RadixCache
from pddnet.control import ControlNode
from pddnet.handoff import AbortReason, DecodeRequest, HandoffHub, HandoffParams, TokenCallback
from pddnet.recompute import TINY, ReferenceModel
from pddnet.transport import Grant, Receiver
from pddnet.wire import encode_tokens

KEY = b"a-decoder-parts-test-secret-0123456789"


class _Engine:
    """Allocates from a counter, records what it is given back."""

    eos_token_id: int | None = None

    def __init__(self) -> None:
        self.freed: list[int] = []
        self._next = 0

    def allocate(self, num_blocks: int) -> Sequence[int]:
        ids = list(range(self._next, self._next + num_blocks))
        self._next += num_blocks
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        self.freed.extend(block_ids)

    def free_blocks(self) -> int:
        return 1000

    async def run(self, request: DecodeRequest, on_token: TokenCallback) -> None:
        raise AssertionError("no part under test runs the engine")

    def stop(self, request_id: int) -> None:
        pass


class _Receiver(Receiver):
    """Records the grants it revokes."""

    def __init__(self) -> None:
        self.cancelled: list[int] = []

    def grant(self, views: Any, ranges: Any, **kw: Any) -> Grant:
        raise AssertionError("the grants under test are fakes")

    async def wait_transfer(self, transfer_id: int) -> None:
        raise AssertionError

    async def wait_layer(self, transfer_id: int, layer: int) -> None:
        raise AssertionError

    def cancel(self, transfer_id: int) -> None:
        self.cancelled.append(transfer_id)

    def statistics(self) -> None:
        return None

    async def aclose(self) -> None:
        pass


class _Grants(BlockGrants):
    """Reserves without a receiver: 3 blocks, a fixed grant; or refuses."""

    def __init__(self, engine: _Engine, receiver: _Receiver, node: ControlNode) -> None:
        super().__init__(engine, _POOL, receiver, node, lease_s=9.0)
        self.refuse = False

    def reserve(self, req: RequestRecord) -> tuple[Any, int]:
        if self.refuse:
            raise ResourceLimitError("no blocks", request_id=req.rid)
        req.owned = req.table = [int(b) for b in self.engine.allocate(3)]
        req.transfer_id = 100 + req.rid
        return Grant(req.transfer_id, 4096, (1024, 4096), "10.0.0.1:7"), 1


_POOL = ReferenceModel.create(TINY, num_blocks=8).pool


@dataclasses.dataclass
class _Parts:
    node: ControlNode
    engine: _Engine
    receiver: _Receiver
    grants: _Grants
    kept: KeptTokens
    hub: HandoffHub
    requests: DecodeRequests


def _parts(node: ControlNode | None = None) -> _Parts:
    node = node or ControlNode("dec", secret=KEY)
    engine, receiver = _Engine(), _Receiver()
    grants = _Grants(engine, receiver, node)
    kept, hub = KeptTokens(node), HandoffHub(node)
    return _Parts(
        node, engine, receiver, grants, kept, hub, DecodeRequests("dec", grants, kept, hub)
    )


def _offer(rid: int = 1, **kw: Any) -> KvOffer:
    fields: dict[str, Any] = {
        "prompt": encode_tokens(np.arange(5)),
        "first_token": 7,
        "max_tokens": 4,
        "relay": "rld",
        "main": "md",
        "sink": "user",
    }
    return KvOffer(rid, **{**fields, **kw})


def _record(rid: int = 1, *, relay: str = "rld", sink: str = "user") -> RequestRecord:
    return RequestRecord(rid, np.arange(5), 7, 4, "p", relay, "md", sink)


# ----------------------------------------------------------------- admission
def test_an_admitted_offer_is_opened_and_answered_with_its_grant() -> None:
    parts = _parts()
    admission = Admission(parts.requests, parts.grants, HandoffParams(), max_requests=4)
    req, accept = admission.admit("p", _offer(3, deadline_s=4.0))
    assert parts.requests[3] is req and req.p == "p" and req.sink == "user"
    assert (accept.request_id, accept.transfer_id, accept.total) == (3, 103, 4096)
    assert (list(accept.layer_ends), accept.address, accept.lease_s) == (
        [1024, 4096],
        "10.0.0.1:7",
        9.0,
    )
    assert parts.kept.get(3) is not None  # its tokens will be kept for the sink
    # the request's deadline caps its waits; the decoder's parameters stay
    assert req.params.kv_timeout_s == 4.0 and req.params.idle_timeout_s == 2.0
    assert admission.params.kv_timeout_s == HandoffParams().kv_timeout_s
    assert (admission.offers, admission.rejected) == (1, 0)


@pytest.mark.parametrize(
    ("offer", "match"),
    [
        (_offer(max_tokens=0), "bad max_tokens"),
        (_offer(max_tokens=(1 << 20) + 1), "bad max_tokens"),
        (_offer(prompt=b""), "empty prompt"),
    ],
)
def test_a_malformed_offer_is_refused_without_reserving(offer: KvOffer, match: str) -> None:
    parts = _parts()
    admission = Admission(parts.requests, parts.grants, HandoffParams(), max_requests=4)
    with pytest.raises(RemoteProtocolError, match=match):
        admission.admit("p", offer)
    assert len(parts.requests) == 0 and parts.engine._next == 0
    assert (admission.offers, admission.rejected) == (1, 0)  # refused, not for want of room


def test_offers_beyond_the_room_are_rejected_and_counted() -> None:
    parts = _parts()
    admission = Admission(parts.requests, parts.grants, HandoffParams(), max_requests=1)
    admission.admit("p", _offer(1))
    with pytest.raises(RemoteProtocolError, match="duplicate"):
        admission.admit("p", _offer(1))
    with pytest.raises(ResourceLimitError, match="max_requests=1"):
        admission.admit("p", _offer(2))
    admission.max_requests = 2
    parts.grants.refuse = True
    with pytest.raises(ResourceLimitError, match="no blocks"):
        admission.admit("p", _offer(2))
    assert list(parts.requests) == [1] and parts.kept.get(2) is None
    assert (admission.offers, admission.rejected) == (4, 2)


# ------------------------------------------------------- requests in progress
async def test_closing_a_request_frees_its_blocks_and_keeps_its_stream() -> None:
    parts = _parts()
    ok, bad = _record(1), _record(2)
    for req in (ok, bad):
        parts.grants.reserve(req)
        parts.requests.open(req)
    parts.kept.record(1, 0, 7, False)
    parts.requests.close(ok, None)
    parts.requests.close(bad, RemoteProtocolError("peer broke it", request_id=2))
    assert len(parts.requests) == 0 and (parts.requests.finished, parts.requests.failed) == (1, 1)
    assert sorted(parts.engine.freed) == [0, 1, 2, 3, 4, 5] and ok.owned == []
    kept = parts.kept.get(1)
    assert kept is not None and kept.state is SourceState.DONE and list(kept.tokens) == [7]
    # no handshake held a live grant (neither landed): both were revoked first
    assert parts.receiver.cancelled == [101, 102]


# ---------------------------------------------------------------------- links
async def test_mains_link_keeps_strange_traffic_only_when_asked() -> None:
    parts = _parts()
    req = _record(5)
    parts.grants.reserve(req)
    keeping = MainLink(
        parts.node, "rld", req, parts.grants, receiver=parts.receiver, keep_strange_traffic=True
    )
    await keeping.cancel_transfer(5, AbortReason.TIMEOUT)  # not strange traffic: revoked
    assert parts.receiver.cancelled == [105] and not req.keep
    await keeping.cancel_transfer(5, AbortReason.RLD_FINISHED)
    assert parts.receiver.cancelled == [105] and req.keep
    await keeping.free_blocks(5)  # the transfer still lands in them
    assert parts.engine.freed == [] and req.owned == [0, 1, 2]

    other = _record(6)
    parts.grants.reserve(other)
    cutting = MainLink(
        parts.node, "rld", other, parts.grants, receiver=parts.receiver, keep_strange_traffic=False
    )
    await cutting.cancel_transfer(6, AbortReason.RLD_FINISHED)
    await cutting.free_blocks(6)
    assert parts.receiver.cancelled[-2:] == [106, 106] and not other.keep  # revoked, then freed
    assert parts.engine.freed == [3, 4, 5]


async def test_relays_link_has_p_cut_off_the_wan_only_when_asked() -> None:
    async with ControlNode("p", secret=KEY) as p, ControlNode("rld", secret=KEY) as rld:
        got: list[CutOffWan] = []
        p.route(CutOffWan, lambda peer, msg: got.append(msg))
        await rld.connect("p", p.address)
        parts = _parts(rld)
        quiet = RelayLink(rld, "md", _record(1), parts.grants, cut_off_wan=False)
        cutting = RelayLink(rld, "md", _record(2), parts.grants, cut_off_wan=True)
        await quiet.cancel_transfer(1, AbortReason.RLD_FINISHED)
        await cutting.cancel_transfer(2, AbortReason.FALLBACK)
        with trio.fail_after(5):
            while not got:
                await trio.sleep(0.01)
        assert got == [CutOffWan(2, "FALLBACK")]  # one connection, in order: 1 never went


# -------------------------------------------------------------------- emitter
async def test_the_emitter_delivers_in_order_and_counts_what_the_sink_took() -> None:
    async with ControlNode("dec", secret=KEY) as dec, ControlNode("user", secret=KEY) as user:
        got: list[Emitted] = []
        user.route(Emitted, lambda peer, msg: got.append(msg))
        await dec.connect("user", user.address)
        parts = _parts(dec)
        req, lost = _record(1), _record(2, sink="gone")
        parts.requests.open(req)
        parts.requests.open(lost)
        emitter = SinkEmitter(dec, parts.kept, parts.requests)
        await emitter.emit(1, 0, 7, False)
        await emitter.emit(1, 1, 8, True)
        await emitter.emit(2, 0, 9, False)  # nobody is connected as "gone"
        with trio.fail_after(5):
            while len(got) < 2:
                await trio.sleep(0.01)
        assert [(m.position, m.token, m.finished, m.source) for m in got] == [
            (0, 7, False, "dec"),
            (1, 8, True, "dec"),
        ]
        assert (req.emitted, req.delivered_final, lost.emitted) == (2, True, 0)
        assert (emitter.emitted, emitter.sink_failures) == (2, 1)
        kept = parts.kept.get(2)
        assert kept is not None and list(kept.tokens) == [9]  # a re-send can still deliver it


# ------------------------------------------------------------ takeover reports
def _takeover(rid: int = 1, position: int = 2, tokens: Sequence[int] = (7, 8)) -> StreamTakeover:
    return StreamTakeover(rid, position, encode_tokens(np.asarray(tokens)))


@pytest.mark.parametrize(
    ("peer", "req", "msg", "match"),
    [
        ("mallory", _record(1), _takeover(), "not the sink"),
        ("user", _record(1, relay=""), _takeover(), "without RLD"),
        ("user", _record(1), _takeover(position=4, tokens=(1, 2, 3, 4)), "outside 0..3"),
        ("user", _record(1), _takeover(position=2, tokens=(7,)), "with 1 tokens"),
    ],
)
def test_a_bad_takeover_report_is_refused(
    peer: str, req: RequestRecord, msg: StreamTakeover, match: str
) -> None:
    parts = _parts()
    parts.requests.open(req)
    reports = TakeoverReports(parts.node, parts.requests, parts.kept, parts.hub, 0.5)
    with pytest.raises(RemoteProtocolError, match=match):
        reports.on_takeover(peer, msg)


def test_a_takeover_report_gets_mds_status_and_waits_for_a_driver() -> None:
    parts = _parts()
    reports = TakeoverReports(parts.node, parts.requests, parts.kept, parts.hub, 0.5)
    unknown = reports.on_takeover("user", _takeover(9))
    assert (unknown.request_id, unknown.state) == (9, int(SourceState.UNKNOWN))
    parts.requests.open(_record(1))
    status = reports.on_takeover("user", _takeover(1))
    # no driver runs it yet: nothing to confirm (no nursery was needed)
    assert (status.state, status.first, status.last) == (int(SourceState.ACTIVE), -1, -1)
    assert reports.acted_on == 0


# ------------------------------------------------------------------ publisher
async def test_the_publisher_sends_the_snapshot_then_changes_and_drops_the_unreachable() -> None:
    async with ControlNode("md", secret=KEY) as md, ControlNode("p", secret=KEY) as p:
        got: list[Any] = []
        p.route(DrcSnapshot, lambda peer, msg: got.append(msg))
        p.route(DrcInserted, lambda peer, msg: got.append(msg))
        await p.connect("md", md.address)
        cache = RadixCache(4)
        publisher = DrcPublisher(md, CacheServer(cache))
        md.route(DrcSnapshotRequest, publisher.on_snapshot_request)
        cache.insert(np.arange(8), [10, 11])  # cached before P subscribes: in the snapshot
        with trio.fail_after(5):
            await p.request("md", DrcSnapshotRequest(0), timeout=5)
        publisher.subscribers.add("gone")  # never connected
        cache.insert(np.arange(12), [10, 11, 12])
        await publisher.publish()
        with trio.fail_after(5):
            while len(got) < 3:
                await trio.sleep(0.01)
        snapshot, covered, inserted = got
        assert isinstance(snapshot, DrcSnapshot) and len(snapshot.keys) == 2
        # the event the snapshot covers goes too (its seq tells P's mirror so), then the change
        assert isinstance(covered, DrcInserted) and covered.seq == snapshot.seq
        assert isinstance(inserted, DrcInserted) and inserted.seq == snapshot.seq + 1
        assert len(inserted.keys) == 1  # only the new block
        assert publisher.subscribers == {"p"}


# ------------------------------------------------------------------ endpoint
def test_main_keeps_the_cache_it_is_given_even_empty() -> None:
    model = ReferenceModel.create(TINY, num_blocks=8)
    cache = RadixCache(model.pool.layout.block_size)
    md = MainEndpoint("md", model.pool, ReferenceEngine(model), secret=KEY, cache=cache)
    assert md.cache is cache and md.drc.cache is cache
