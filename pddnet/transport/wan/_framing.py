"""Link frames of the WAN data connections (everything that is not a chunk).

A WAN data connection carries, sender to receiver, chunks (a 40-byte
:class:`pddnet.wire.ChunkHeader` then the payload) and, receiver to sender,
acknowledgements. Both directions also carry small *link frames* of the same
40 bytes, told apart from a chunk header by their magic::

    offset size field
    0      4    magic  b"PDDX"
    4      1    version (1)
    5      1    kind    (LinkKind)
    6      1    code    (LinkCode, for FAIL/CANCELLED; 0 otherwise)
    7      1    reserved, 0
    8      8    transfer_id
    16     8    offset   (logical, for ACK/DUP)
    24     8    length   (for ACK/DUP)
    32     4    reserved, 0
    36     4    CRC32C of bytes 0..36

Receiver to sender: ``ACK`` (chunk verified), ``DUP`` (a hedged copy was
dropped while its twin was in progress, so it proves nothing), ``FAIL`` (the
receiver failed the transfer, ``code`` says why), ``CANCELLED`` (the receiver
cancelled or timed out the transfer). Sender to receiver: ``CANCEL`` (the
sender cancelled the transfer), ``HELLO`` (``transfer_id`` = session id,
``offset`` = stream index; informational) and ``PAD`` (``length`` bytes of
padding follow, at most ``K_MAX_PAD``, which the receiver reads and drops: an
express stream's warm-up, so its congestion window is open before the first
urgent chunk needs it).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from crc32c import crc32c

from ..._errors import RemoteProtocolError
from ...wire import K_CHUNK_HEADER_SIZE

__all__ = ["K_LINK_FRAME_SIZE", "K_LINK_MAGIC", "K_MAX_PAD", "LinkCode", "LinkFrame", "LinkKind"]

K_LINK_MAGIC = b"PDDX"
K_LINK_VERSION = 1
_FRAME = struct.Struct("<4sBBBBQQQI")
_CRC = struct.Struct("<I")
K_LINK_FRAME_SIZE = _FRAME.size + _CRC.size
K_MAX_PAD = 4 << 20  # most padding bytes one PAD frame may announce
assert K_LINK_FRAME_SIZE == K_CHUNK_HEADER_SIZE  # one fixed read size per frame


class LinkKind(enum.IntEnum):
    HELLO = 1
    ACK = 2
    DUP = 3
    FAIL = 4
    CANCEL = 5
    CANCELLED = 6
    PAD = 7


class LinkCode(enum.IntEnum):
    NONE = 0
    PROTOCOL = 1
    TIMEOUT = 2
    CANCELLED = 3
    CHECKSUM = 4


@dataclass(frozen=True, slots=True)
class LinkFrame:
    """One link frame."""

    kind: LinkKind
    transfer_id: int
    offset: int = 0
    length: int = 0
    code: LinkCode = LinkCode.NONE

    def encode(self) -> bytes:
        head = _FRAME.pack(
            K_LINK_MAGIC,
            K_LINK_VERSION,
            self.kind,
            self.code,
            0,
            self.transfer_id,
            self.offset,
            self.length,
            0,
        )
        return head + _CRC.pack(crc32c(head))

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> LinkFrame:
        """Parse one link frame.

        Raises:
            RemoteProtocolError: on a wrong size, magic, version, kind, code or CRC.
        """
        if len(data) != K_LINK_FRAME_SIZE:
            raise RemoteProtocolError(f"link frame is {K_LINK_FRAME_SIZE} bytes, got {len(data)}")
        head = bytes(data[: _FRAME.size])
        (crc,) = _CRC.unpack_from(data, _FRAME.size)
        magic, version, kind, code, r0, tid, off, length, r1 = _FRAME.unpack(head)
        if magic != K_LINK_MAGIC:
            raise RemoteProtocolError(f"bad link frame magic {magic!r}")
        if crc32c(head) != crc:
            raise RemoteProtocolError("link frame CRC mismatch")
        if version != K_LINK_VERSION or r0 or r1:
            raise RemoteProtocolError(f"unsupported link frame version {version}")
        try:
            return cls(LinkKind(kind), tid, off, length, LinkCode(code))
        except ValueError as exc:
            raise RemoteProtocolError(f"bad link frame kind/code {kind}/{code}") from exc
