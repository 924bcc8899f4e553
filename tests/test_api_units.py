"""Pure logic of the API: leases and handshake blobs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet import KVLayout, LocalProtocolError, RemoteProtocolError
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

    bad = msgpack.packb([1, "x", "king", "e", 0, "c", "d", INFO.layout.to_dict()])
    with pytest.raises(RemoteProtocolError, match="role"):
        EndpointInfo.from_blob(bad)
    with pytest.raises(RemoteProtocolError, match="large"):
        EndpointInfo.from_blob(b"x" * 5000)
