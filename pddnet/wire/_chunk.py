"""The data-plane chunk header (see docs/wire.md for the byte layout).

Every chunk of KV bytes on a data connection is preceded by a fixed 40-byte
little-endian header. The header carries its own CRC so that a corrupted
length or offset is caught before the receiver trusts it, and a checksum of
the payload computed with the algorithm the header names: in the header, or,
with :data:`K_CHUNK_FLAG_TRAILER`, in an 8-byte little-endian trailer right
after the payload (the sender then hashes the bytes after writing them, while
they are in cache, instead of in a cold pass before).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass

from crc32c import crc32c

from .._errors import RemoteProtocolError

__all__ = [
    "K_CHUNK_MAGIC",
    "K_CHUNK_VERSION",
    "K_CHUNK_FLAG_TRAILER",
    "K_CHUNK_HEADER_SIZE",
    "K_CHUNK_TRAILER_SIZE",
    "K_MAX_CHUNK_LENGTH",
    "ChecksumAlgo",
    "ChunkHeader",
    "ChunkKind",
    "checksum",
]

K_CHUNK_MAGIC = b"PDDC"
K_CHUNK_VERSION = 1
# Hard ceiling on one chunk's payload, whatever the negotiated chunk size.
K_MAX_CHUNK_LENGTH = 64 << 20

_HEADER = struct.Struct("<4sBBBBQQIQ")  # without the trailing header CRC
_HEADER_CRC = struct.Struct("<I")
K_CHUNK_HEADER_SIZE = _HEADER.size + _HEADER_CRC.size  # 40
# flags: the payload checksum follows the payload (u64 little-endian) and the
# header's checksum field is 0
K_CHUNK_FLAG_TRAILER = 0x01
K_CHUNK_TRAILER_SIZE = 8
_KNOWN_FLAGS = K_CHUNK_FLAG_TRAILER


class ChunkKind(enum.IntEnum):
    DATA = 0


class ChecksumAlgo(enum.IntEnum):
    NONE = 0
    CRC32C = 1
    XXH3_64 = 2


def _xxh3(data: bytes | memoryview) -> int:
    import xxhash

    return int(xxhash.xxh3_64_intdigest(data))


_CHECKSUMS: dict[ChecksumAlgo, Callable[[bytes | memoryview], int]] = {
    ChecksumAlgo.NONE: lambda data: 0,
    ChecksumAlgo.CRC32C: crc32c,
    ChecksumAlgo.XXH3_64: _xxh3,
}


def checksum(algo: ChecksumAlgo, data: bytes | memoryview) -> int:
    """The payload checksum of ``data`` under ``algo``."""
    return _CHECKSUMS[algo](data)


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """One chunk's header.

    ``offset`` is the chunk's position in the transfer's *logical* byte stream
    (the concatenation of the granted ranges), so the receiver can bounds-check
    it against the grant with one comparison. With :data:`K_CHUNK_FLAG_TRAILER`
    in ``flags`` the checksum is in the trailer (``checksum`` is 0).
    """

    transfer_id: int
    offset: int
    length: int
    checksum: int
    algo: ChecksumAlgo = ChecksumAlgo.CRC32C
    kind: ChunkKind = ChunkKind.DATA
    flags: int = 0

    @property
    def trailer(self) -> int:
        """Bytes of checksum trailer after the payload (0 or :data:`K_CHUNK_TRAILER_SIZE`)."""
        return K_CHUNK_TRAILER_SIZE if self.flags & K_CHUNK_FLAG_TRAILER else 0

    def encode(self) -> bytes:
        head = _HEADER.pack(
            K_CHUNK_MAGIC,
            K_CHUNK_VERSION,
            self.kind,
            self.algo,
            self.flags,
            self.transfer_id,
            self.offset,
            self.length,
            self.checksum,
        )
        return head + _HEADER_CRC.pack(crc32c(head))

    @classmethod
    def decode(
        cls, data: bytes | bytearray | memoryview, max_length: int = K_MAX_CHUNK_LENGTH
    ) -> ChunkHeader:
        """Parse exactly one header.

        Raises:
            RemoteProtocolError: on a short buffer, bad magic, version, kind,
                algorithm or flags (unknown ones, or a trailer with a checksum
                in the header too), a header CRC mismatch, or a length over
                ``max_length``.
        """
        if len(data) != K_CHUNK_HEADER_SIZE:
            raise RemoteProtocolError(
                f"chunk header is {K_CHUNK_HEADER_SIZE} bytes, got {len(data)}"
            )
        head = bytes(data[: _HEADER.size])
        (crc,) = _HEADER_CRC.unpack_from(data, _HEADER.size)
        magic, version, kind, algo, flags, tid, offset, length, csum = _HEADER.unpack(head)
        if magic != K_CHUNK_MAGIC:
            raise RemoteProtocolError(f"bad chunk magic {magic!r}")
        if crc32c(head) != crc:
            raise RemoteProtocolError("chunk header CRC mismatch", transfer_id=tid)
        if version != K_CHUNK_VERSION:
            raise RemoteProtocolError(f"unsupported chunk version {version}", transfer_id=tid)
        try:
            kind_e = ChunkKind(kind)
            algo_e = ChecksumAlgo(algo)
        except ValueError as exc:
            raise RemoteProtocolError(
                f"bad chunk kind/algo {kind}/{algo}", transfer_id=tid
            ) from exc
        if flags & ~_KNOWN_FLAGS:
            raise RemoteProtocolError(f"unknown chunk flags {flags:#x}", transfer_id=tid)
        if flags & K_CHUNK_FLAG_TRAILER and csum:
            raise RemoteProtocolError(
                "chunk checksum both in the header and in a trailer", transfer_id=tid
            )
        if length == 0 or length > max_length:
            raise RemoteProtocolError(
                f"chunk length {length} outside [1, {max_length}]", transfer_id=tid
            )
        return cls(tid, offset, length, csum, algo_e, kind_e, flags)
