from __future__ import annotations

import dataclasses
import typing

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet import AuthError, LocalProtocolError, RemoteProtocolError
from pddnet.wire import (
    ControlLimits,
    FrameKind,
    Hello,
    Ping,
    decode_frame,
    decode_tokens,
    encode_frame,
    encode_tokens,
    registered_messages,
)
from pddnet.wire._control import K_TAG_SIZE, _tag

KEY = b"k" * 32
LIM = ControlLimits(max_message_bytes=1 << 16, max_tokens=512, max_ranges=64, max_str=64)


def strategy_for(tp: object) -> st.SearchStrategy[object]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, __import__("types").UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return st.none() | strategy_for(inner)
    if origin is list:
        return st.lists(strategy_for(typing.get_args(tp)[0]), max_size=8)
    return {
        int: st.integers(0, 2**63 - 1),
        float: st.floats(allow_nan=False),
        bool: st.booleans(),
        str: st.text(max_size=16),
        bytes: st.binary(max_size=64),
    }[tp]  # type: ignore[index]


def message_strategy(cls: type) -> st.SearchStrategy[object]:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: strategy_for(hints[f.name]) for f in dataclasses.fields(cls)})


ALL = sorted(registered_messages().items())


@pytest.mark.parametrize("type_id,cls", ALL, ids=[c.__name__ for _, c in ALL])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_every_message_round_trips(type_id: int, cls: type, data: st.DataObject) -> None:
    msg = data.draw(message_strategy(cls))
    kind = data.draw(st.sampled_from(list(FrameKind)))
    raw = encode_frame(msg, key=KEY, src="a", dst="b", seq=5, corr=9, kind=kind, limits=LIM)
    frame = decode_frame(raw, key=KEY, src="a", dst="b", limits=LIM)
    assert frame.message == msg and frame.kind is kind and (frame.seq, frame.corr) == (5, 9)


def test_tag_binds_sender_and_recipient() -> None:
    raw = encode_frame(Ping(b"x"), key=KEY, src="a", dst="b", seq=1)
    for src, dst, key in [("c", "b", KEY), ("a", "c", KEY), ("a", "b", b"j" * 32)]:
        with pytest.raises(AuthError):
            decode_frame(raw, key=key, src=src, dst=dst)
    tampered = bytearray(raw)
    tampered[-1] ^= 1
    with pytest.raises(AuthError):
        decode_frame(bytes(tampered), key=KEY, src="a", dst="b")


def _signed(body: bytes) -> bytes:
    return _tag(KEY, "a", "b", body) + body


@pytest.mark.parametrize(
    "body, match",
    [
        (msgpack.packb([2, 0, 0, 1, 0, b""]), "version"),
        (msgpack.packb([1, 250, 0, 1, 0]), "unknown"),
        (msgpack.packb([1, 0, 7, 1, 0, b""]), "envelope"),
        (msgpack.packb([1, 0, 0, 1, 0]), "fields"),
        (msgpack.packb([1, 0, 0, 1, 0, "str-not-bytes"]), "schema"),
        (msgpack.packb({"a": 1}), "map|envelope|malformed"),
        (msgpack.packb([1, 3, 0, 1, 0, "n" * 100, 1, b""]), "malformed|schema"),
        (msgpack.packb([1, 3, 0, 1, 0, "n", True, b""]), "schema"),
        (b"\xc1", "malformed"),
        (msgpack.packb([1, 0, 0, -1, 0, b""]), "range"),
        (msgpack.packb(list(range(100))), "malformed"),
    ],
)
def test_malformed_envelopes_are_remote_protocol_errors(body: bytes, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        decode_frame(_signed(body), key=KEY, src="a", dst="b", limits=LIM)


def test_size_limits_are_enforced_both_ways() -> None:
    with pytest.raises(RemoteProtocolError, match="limit"):
        decode_frame(b"x" * (LIM.max_message_bytes + 1), key=KEY, src="a", dst="b", limits=LIM)
    with pytest.raises(LocalProtocolError):
        encode_frame(Ping(b"x" * (1 << 17)), key=KEY, src="a", dst="b", seq=1, limits=LIM)
    with pytest.raises(LocalProtocolError):
        encode_frame(Hello("n" * 100, 1), key=KEY, src="a", dst="b", seq=1, limits=LIM)


@settings(max_examples=2500, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_authenticated_bodies(body: bytes) -> None:
    """Any body with a valid tag decodes or raises RemoteProtocolError, nothing else."""
    try:
        frame = decode_frame(_signed(body), key=KEY, src="a", dst="b", limits=LIM)
    except RemoteProtocolError:
        return
    assert type(frame.message) in registered_messages().values()


@settings(max_examples=2500, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_raw_frames(data: bytes) -> None:
    with pytest.raises((RemoteProtocolError, AuthError)):
        decode_frame(data, key=KEY, src="a", dst="b", limits=LIM)


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=300))
def test_token_varints_round_trip(tokens: list[int]) -> None:
    raw = encode_tokens(tokens)
    assert len(raw) <= 5 * len(tokens)
    assert decode_tokens(raw, max_tokens=300).tolist() == tokens


def test_token_payload_for_100_tokens_of_a_128k_vocab() -> None:
    tokens = np.random.default_rng(0).integers(65536, 131072, 100)
    assert len(encode_tokens(tokens)) == 300


@settings(max_examples=2500, deadline=None)
@given(st.binary(max_size=64))
def test_fuzz_token_decoder(data: bytes) -> None:
    try:
        out = decode_tokens(data, max_tokens=10)
    except RemoteProtocolError:
        return
    assert out.size <= 10 and (out.size == 0 or out.max() < 2**32)


def test_token_limits() -> None:
    with pytest.raises(RemoteProtocolError):
        decode_tokens(encode_tokens(range(11)), max_tokens=10)
    with pytest.raises(RemoteProtocolError, match="truncated"):
        decode_tokens(b"\x80", max_tokens=10)
    with pytest.raises(RemoteProtocolError, match="5 bytes"):
        decode_tokens(b"\x80\x80\x80\x80\x80\x01", max_tokens=10)
    with pytest.raises(ValueError):
        encode_tokens([-1])


def test_tag_size() -> None:
    # (replay protection is the control node's PathGuard: tests/test_control_paths.py)
    assert K_TAG_SIZE == 16
