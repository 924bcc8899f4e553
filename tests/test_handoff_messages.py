"""Handoff messages: compact token batches, acks with positions, fuzzed decoding."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pddnet.handoff as handoff
from pddnet import RemoteProtocolError
from pddnet.handoff import (
    AbortReason,
    BatchAcked,
    BatchReceived,
    HandoffAbort,
    HandoffAck,
    KvLanded,
    KvReady,
    PeerAborted,
    TokenBatch,
    event_for_message,
)
from pddnet.wire import K_TAG_SIZE, decode_frame, encode_frame, registered_messages

KEY = b"k" * 32
WORST_RID = (1 << 64) - 1


def frame(msg: object) -> bytes:
    return encode_frame(msg, key=KEY, src="rld0", dst="md0", seq=time.time_ns())  # type: ignore[arg-type]


def test_type_ids_are_in_the_handoff_range() -> None:
    for cls in (TokenBatch, HandoffAck, KvReady, HandoffAbort):
        assert 32 <= cls.TYPE_ID <= 47
        assert registered_messages()[cls.TYPE_ID] is cls


def test_hundred_token_frame_is_under_600_bytes() -> None:
    """100 realistic 17-bit ids: <= 5 B/token plus <= 64 B for the whole frame."""
    rng = np.random.default_rng(0)
    toks = rng.integers(1 << 16, 1 << 17, size=100)
    msg = TokenBatch.build(WORST_RID, 1 << 30, toks.tolist(), False)
    data = frame(msg)
    overhead = len(data) - len(msg.tokens)
    assert len(msg.tokens) == 300  # 3 varint bytes per 17-bit id
    assert overhead <= 64, overhead
    assert len(data) <= 600
    # The worst case, every id at uint32 max: 5 bytes per token plus the same overhead.
    worst = TokenBatch.build(WORST_RID, 1 << 30, [(1 << 32) - 1] * 100, True)
    assert len(frame(worst)) <= 5 * 100 + 64


def test_frame_roundtrip_to_events() -> None:
    toks = [0, 1, 127, 128, 131071, (1 << 32) - 1]
    msgs = [
        (TokenBatch.build(5, 40, toks, True), BatchReceived(40, tuple(toks), True)),
        (HandoffAck(5, 46, True, 1234), BatchAcked(46, True, 1234.0)),
        (HandoffAck(5, 46, False, 0), BatchAcked(46, False, None)),
        (KvReady(5), KvLanded()),
        (HandoffAbort(5, int(AbortReason.RLD_FINISHED)), PeerAborted(AbortReason.RLD_FINISHED)),
    ]
    for msg, ev in msgs:
        got = decode_frame(frame(msg), key=KEY, src="rld0", dst="md0").message
        assert got == msg
        assert event_for_message(got) == ev
        assert handoff.request_id_of(got) == 5


def test_ack_frame_is_small() -> None:
    assert len(frame(HandoffAck(WORST_RID, 1 << 20, True, 5000))) <= K_TAG_SIZE + 32


@given(st.binary(max_size=64), st.integers(-5, 1 << 40))
def test_bad_batches_give_remote_protocol_error(payload: bytes, start: int) -> None:
    msg = TokenBatch(1, start, payload, False)
    try:
        ev = event_for_message(msg)
    except RemoteProtocolError:
        return
    assert isinstance(ev, BatchReceived) and ev.start == start >= 0


def test_unknown_abort_reason_is_remote_error() -> None:
    with pytest.raises(RemoteProtocolError, match="abort reason"):
        event_for_message(HandoffAbort(1, 99))


def test_public_exports() -> None:
    for name in handoff.__all__:
        assert hasattr(handoff, name), name
    assert sorted(handoff.__all__) == sorted(set(handoff.__all__))
