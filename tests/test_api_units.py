"""Pure logic of the API: leases and handshake blobs."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet import KVLayout, LayoutMismatch, LocalProtocolError, RemoteProtocolError
from pddnet.api import EndpointInfo, LeaseTable


def test_lease_lifecycle() -> None:
    t = LeaseTable(duration_s=10)
    t.acquire(1, (4, 5), {"rld", "md"}, now=0)
    with pytest.raises(LocalProtocolError):
        t.acquire(1, (6,), {"md"}, now=0)
    assert t.finish(1, "rld") is None  # MD still reading
    assert t.renew(1, now=8) and t.next_expiry() == 18
    assert t.expire(now=17.9) == []
    assert t.finish(1, "md") == (4, 5)
    assert 1 not in t and t.held_blocks() == 0
    assert not t.renew(1, now=9)


def test_unrenewed_lease_expires() -> None:
    t = LeaseTable(duration_s=2)
    t.acquire(7, (1,), {"md"}, now=0)
    t.acquire(8, (2,), {"md"}, now=1)
    dead = t.expire(now=2.5)
    assert [lease.request_id for lease in dead] == [7]
    assert t.release(8) == (2,) and t.release(8) is None


INFO = EndpointInfo(
    "md0",
    "main",
    "engine-b",
    3,
    "tcp://10.0.0.2:5552",
    "10.0.0.2:6000",
    KVLayout(4, 2, 16, 16, "float32"),
    "tiny-llama@3",
)


def test_blob_round_trip() -> None:
    assert EndpointInfo.from_blob(INFO.blob()) == INFO


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_blob_decoder(data: bytes) -> None:
    """Any bytes decode to a valid info or raise RemoteProtocolError; nothing else."""
    try:
        info = EndpointInfo.from_blob(data)
    except RemoteProtocolError:
        return
    assert EndpointInfo.from_blob(info.blob()) == info


def test_blob_rejects_bad_role_and_oversize() -> None:
    import msgpack

    bad = msgpack.packb([2, "x", "king", "e", 0, "c", "d", INFO.layout.to_dict(), ""])
    with pytest.raises(RemoteProtocolError, match="role"):
        EndpointInfo.from_blob(bad)
    with pytest.raises(RemoteProtocolError, match="large"):
        EndpointInfo.from_blob(b"x" * 5000)
    old = msgpack.packb([1, "x", "main", "e", 0, "c", "d", INFO.layout.to_dict()])
    with pytest.raises(RemoteProtocolError, match="version 1"):
        EndpointInfo.from_blob(old)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (
            {"layout": KVLayout(4, 2, 16, 16, "float16")},
            "dtype 'float32' at md0 (main) vs 'float16'",
        ),
        ({"layout": KVLayout(4, 2, 16, 16, "float32", interior="hptd")}, "interior"),
        ({"layout": KVLayout(4, 1, 32, 16, "float32")}, "num_kv_heads 2 at md0"),
        ({"layout": KVLayout(4, 2, 16, 32, "float32")}, "block_size 16 at md0"),
        ({"model": "tiny-llama@4"}, "'tiny-llama@3' at md0 (main) vs 'tiny-llama@4' at p0"),
        ({"model": ""}, "(none stated)"),
    ],
)
def test_a_peer_whose_kv_means_something_else_is_refused(change: dict[str, Any], said: str) -> None:
    """Same bytes per block is not enough (fp16 vs bf16, heads, order, model)."""
    peer = dataclasses.replace(INFO, name="p0", role="prefill", **change)
    with pytest.raises(LayoutMismatch, match=re.escape(said)):
        INFO.check_peer(peer)
    # a fused layout of the same blocks is the same KV
    INFO.check_peer(dataclasses.replace(INFO, layout=dataclasses.replace(INFO.layout, fused=True)))
