"""Compact token-id encoding: unsigned LEB128 varints, vectorised.

Token ids below 2**35 take at most 5 bytes; a 128K vocabulary takes 3 bytes
per token, so 100 eager tokens are about 300 bytes of payload.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import RemoteProtocolError

__all__ = ["K_MAX_TOKEN_ID", "encode_tokens", "decode_tokens"]

K_MAX_TOKEN_ID = (1 << 32) - 1  # tokens are uint32: at most 5 varint bytes
_SHIFTS = np.array([0, 7, 14, 21, 28], dtype=np.uint64)


def encode_tokens(tokens: Any) -> bytes:
    """Encode token ids (any int sequence or array) as concatenated varints."""
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        return b""
    if ids.min() < 0 or ids.max() > K_MAX_TOKEN_ID:
        raise ValueError(f"token ids must lie in [0, {K_MAX_TOKEN_ID}]")
    vals = ids.astype(np.uint64)
    nbytes = np.ones(ids.size, np.int64)
    for k in range(1, 5):
        nbytes += vals >= (np.uint64(1) << np.uint64(7 * k))
    # byte j of token i: ((v >> 7j) & 0x7f) | 0x80 unless j is its last byte
    groups = (vals[:, None] >> _SHIFTS[None, :]) & np.uint64(0x7F)
    cont = np.arange(5)[None, :] < (nbytes[:, None] - 1)
    out = (groups | (cont.astype(np.uint64) << np.uint64(7))).astype(np.uint8)
    keep = np.arange(5)[None, :] < nbytes[:, None]
    return out[keep].tobytes()


def decode_tokens(data: bytes, max_tokens: int) -> npt.NDArray[np.int64]:
    """Decode concatenated varints.

    Raises:
        RemoteProtocolError: on a truncated varint, a varint over 5 bytes or
            over uint32, or more than ``max_tokens`` tokens.
    """
    if len(data) > 5 * max_tokens:
        raise RemoteProtocolError(f"token payload of {len(data)} bytes exceeds the limit")
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size == 0:
        return np.empty(0, np.int64)
    ends = np.flatnonzero(raw < 0x80)
    if ends.size == 0 or ends[-1] != raw.size - 1:
        raise RemoteProtocolError("truncated token varint")
    if ends.size > max_tokens:
        raise RemoteProtocolError(f"{ends.size} tokens exceed the limit of {max_tokens}")
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if lengths.max() > 5:
        raise RemoteProtocolError("token varint longer than 5 bytes")
    pos_in_group = np.arange(raw.size) - np.repeat(starts, lengths)
    parts = (raw & 0x7F).astype(np.uint64) << _SHIFTS[pos_in_group]
    vals = np.add.reduceat(parts, starts)
    if vals.max() > K_MAX_TOKEN_ID:
        raise RemoteProtocolError("token id exceeds uint32")
    return vals.astype(np.int64)
