from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet import RemoteProtocolError
from pddnet.wire import K_CHUNK_HEADER_SIZE, ChecksumAlgo, ChunkHeader, checksum

U64 = st.integers(0, 2**64 - 1)
headers = st.builds(
    ChunkHeader,
    transfer_id=U64,
    offset=U64,
    length=st.integers(1, 1 << 20),
    checksum=U64,
    algo=st.sampled_from(list(ChecksumAlgo)),
)


@given(headers)
def test_header_round_trip(h: ChunkHeader) -> None:
    raw = h.encode()
    assert len(raw) == K_CHUNK_HEADER_SIZE == 40
    assert ChunkHeader.decode(raw, max_length=1 << 20) == h


def test_header_byte_layout_matches_docs() -> None:
    h = ChunkHeader(transfer_id=7, offset=4096, length=512, checksum=0xDEADBEEF)
    raw = h.encode()
    assert raw[:4] == b"PDDC" and raw[4] == 1 and raw[5] == 0 and raw[6] == 1 and raw[7] == 0
    assert struct.unpack_from("<QQIQ", raw, 8) == (7, 4096, 512, 0xDEADBEEF)


@pytest.mark.parametrize("byte", range(40))
def test_every_corrupted_header_byte_is_rejected(byte: int) -> None:
    raw = bytearray(ChunkHeader(1, 2, 3, 4).encode())
    raw[byte] ^= 0x40
    with pytest.raises(RemoteProtocolError):
        ChunkHeader.decode(raw)


def test_oversized_and_empty_chunks_are_rejected() -> None:
    with pytest.raises(RemoteProtocolError, match="length"):
        ChunkHeader.decode(ChunkHeader(1, 0, 2048, 0).encode(), max_length=1024)
    with pytest.raises(RemoteProtocolError, match="length"):
        ChunkHeader.decode(ChunkHeader(1, 0, 0, 0).encode())
    with pytest.raises(RemoteProtocolError):
        ChunkHeader.decode(ChunkHeader(1, 0, 1, 0).encode()[:-1])


@settings(max_examples=3000, deadline=None)
@given(st.binary(min_size=0, max_size=64))
def test_fuzz_header_decoder(data: bytes) -> None:
    try:
        h = ChunkHeader.decode(data)
    except RemoteProtocolError:
        return
    assert h.encode() == data


@pytest.mark.parametrize("algo", list(ChecksumAlgo))
def test_checksums_detect_a_flipped_bit(algo: ChecksumAlgo) -> None:
    data = bytearray(range(256)) * 16
    before = checksum(algo, data)
    data[1000] ^= 1
    assert (checksum(algo, data) != before) == (algo is not ChecksumAlgo.NONE)
