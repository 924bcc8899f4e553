"""The local path's control messages: their kinds, codes and byte layout.

A control message is a fixed little-endian header ``u32 length, u8 kind, u8
code, u32 sender_id, u32 transfer_id`` and a blob (no msgpack on the hot
path); ``length`` counts the bytes after itself. The kinds:

* HELLO (sender -> receiver's public inbox): the blob is [the sender's
  CHALLENGE frame] + its worker address; code bit 0 (:data:`K_HELLO_AUTH`)
  when the frame is there, bit 1 (:data:`K_HELLO_ERRH`) when the sender's
  endpoint asked UCX for error handling, which the receiver's endpoint back
  must match.
* AUTH (either way): 40-byte handshake frames (:mod:`pddnet.wire._auth`).
* ACCEPT (receiver): the sender is admitted; the blob is the address of the
  UCX worker the receiver made for this session (empty: the public one), to
  which the sender then sends everything else.
* BYE (sender): the session ends, its worker can go.
* START (sender): the receiver knows whom to tell and posts the transfer's
  receives; sent right before the transfer's first piece, so both arrive in
  one wake-up, or at ``start`` when nothing is ready yet.
* DATA (sender): START with a small transfer's bytes inline after the header.
* DONE (receiver): every piece landed; one per sender per round of
  completions, further transfer ids as u32s in the blob (:func:`pack_done`).
* CANCEL (either way), with a :class:`Code`.
"""

from __future__ import annotations

import enum
import struct
from typing import Any

from ..._errors import PddnetError, RemoteProtocolError, TransferCancelled, TransferTimeout

__all__ = [
    "K_CTRL_MAX",
    "K_HELLO_AUTH",
    "K_HELLO_ERRH",
    "K_INLINE_MAX",
    "Code",
    "Ctl",
    "Message",
    "error_for",
    "header",
    "pack",
    "pack_done",
    "unpack",
    "unpack_done",
]

K_CTRL_MAX = 1 << 16  # the largest control message (each inbox's receive buffer)
K_DONE_BATCH = (K_CTRL_MAX - 64) // 4  # transfer ids per DONE message
# A transfer of at most this many bytes, all ready at start, travels inside its
# START message (DATA) when the grant allows it (host memory): one message each
# way instead of START + pieces + posted receives. Below UCX's rendezvous
# threshold (8 KiB), so it is one eager message.
K_INLINE_MAX = 8192 - 64
K_HELLO_AUTH = 1  # HELLO code bits: a CHALLENGE frame leads the blob
K_HELLO_ERRH = 2  # the sender's endpoint has UCX error handling (both ends must agree)


class Ctl(enum.IntEnum):
    """A control message's kind."""

    HELLO = 1
    START = 2
    DONE = 3
    CANCEL = 4
    AUTH = 5
    ACCEPT = 6  # blob: the address of the session's own UCX worker (empty: the public one)
    DATA = 7  # START with a small transfer's bytes inline
    BYE = 8  # sender -> receiver: the session ends (its worker can be retired)


class Code(enum.IntEnum):
    """Why a transfer was cancelled (a CANCEL's code)."""

    CANCELLED = 1
    TIMEOUT = 2
    REJECTED = 3
    HALTED = 4  # the receiver halted this session's UCX worker: every transfer of it failed


_HDR = struct.Struct("<IBBII")  # length (of the rest), kind, code, sender, transfer id

# A decoded message: kind, sender id, transfer id, code, blob.
Message = tuple[Ctl, int, int, int, bytes]


def header(kind: Ctl, sender: int, tid: int, blob_len: int, code: int = 0) -> bytes:
    """The header of a message whose blob (sent after it) is ``blob_len`` bytes."""
    return _HDR.pack(_HDR.size - 4 + blob_len, kind, code, sender, tid)


def pack(kind: Ctl, sender: int, tid: int, code: int = 0, blob: bytes = b"") -> bytes:
    """One control message."""
    return _HDR.pack(_HDR.size - 4 + len(blob), kind, code, sender, tid) + blob


def unpack(buf: Any) -> Message:
    """Decode one control message from the start of ``buf``.

    Raises:
        RemoteProtocolError: if it is truncated, oversized, too short or of an
            unknown kind.
    """
    mv = memoryview(buf)
    if mv.nbytes < _HDR.size:
        raise RemoteProtocolError("truncated UCX control message")
    n, kind, code, sender, tid = _HDR.unpack_from(mv)
    if n > min(K_CTRL_MAX, mv.nbytes) - 4:
        raise RemoteProtocolError("oversized UCX control message")
    if n < _HDR.size - 4:
        raise RemoteProtocolError(f"UCX control message of {n} bytes is too short")
    try:
        ctl = Ctl(kind)
    except ValueError:
        raise RemoteProtocolError(f"unknown UCX control message kind {kind}") from None
    return ctl, sender, tid, code, bytes(mv[_HDR.size : 4 + n])


def pack_done(sender: int, tids: list[int]) -> list[bytes]:
    """DONE messages for ``tids``: each has its first transfer id in the header,
    the rest as u32s in the blob, at most :data:`K_DONE_BATCH` ids per message."""
    out = []
    for i in range(0, len(tids), K_DONE_BATCH):
        part = tids[i : i + K_DONE_BATCH]
        more = struct.pack(f"<{len(part) - 1}I", *part[1:])
        out.append(pack(Ctl.DONE, sender, part[0], 0, more))
    return out


def unpack_done(tid: int, blob: bytes, peer: str) -> tuple[int, ...]:
    """The transfer ids of one DONE message (``tid`` from its header).

    Raises:
        RemoteProtocolError: if the blob is not a whole number of u32s.
    """
    if len(blob) % 4:
        raise RemoteProtocolError("malformed DONE batch", peer=peer)
    return (tid, *struct.unpack(f"<{len(blob) // 4}I", blob))


def error_for(code: int, tid: int, peer: str) -> PddnetError:
    """The error a peer's CANCEL with ``code`` stands for."""
    if code == Code.TIMEOUT:
        return TransferTimeout("the peer's deadline passed", transfer_id=tid, peer=peer)
    if code == Code.REJECTED:
        return RemoteProtocolError("the receiver rejected the transfer", transfer_id=tid, peer=peer)
    return TransferCancelled("the peer cancelled the transfer", transfer_id=tid, peer=peer)
