"""Redundant paths to one peer: identities and the receive-side guard (sans-IO).

A node may reach a peer over several TCP connections at once (``connect(...,
paths=2)``): the *primary* DEALER carries the node's name as its zmq identity,
each *twin* ``k`` (1 <= k < :data:`K_MAX_PATHS`) carries ``name + b"\\0" +
bytes([k])``. Every frame to that peer is sent on every live path with the
same ``seq`` and the same authentication tag (the tag binds the node's name,
not the path), and the first copy to arrive wins.

:class:`PathGuard` is the receiving side: replay protection per path and
duplicate suppression across the paths of one sender. For a sender with a
single path it is a plain replay guard: each frame newer than the last, and
within the time window.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from .._errors import LocalProtocolError

__all__ = [
    "K_DEDUP_MEMORY",
    "K_MAX_PATHS",
    "PathGuard",
    "Verdict",
    "path_identity",
    "split_identity",
]

K_MAX_PATHS = 4  # the primary and up to three twins per peer
K_DEDUP_MEMORY = 4096  # accepted seqs remembered per sender (and at most one replay window)
_SEP = b"\x00"


def path_identity(name: str, path: int) -> bytes:
    """The zmq identity of ``name``'s DEALER number ``path`` (0 is the primary).

    Raises:
        LocalProtocolError: if ``path`` is out of range or the identity would
            not fit zmq's 255-byte limit.
    """
    raw = name.encode()
    if path == 0:
        return raw
    if not 0 < path < K_MAX_PATHS:
        raise LocalProtocolError(f"path {path} out of range 0..{K_MAX_PATHS - 1}", peer=name)
    ident = raw + _SEP + bytes([path])
    if len(ident) > 255:
        raise LocalProtocolError(f"node name too long for a twin path: {name[:40]!r}...")
    return ident


def split_identity(ident: bytes) -> tuple[str, int] | None:
    """``(name, path)`` for a zmq identity made by :func:`path_identity`; None if malformed."""
    raw, sep, suffix = ident.partition(_SEP)
    if sep and (len(suffix) != 1 or not 0 < suffix[0] < K_MAX_PATHS):
        return None
    try:
        name = raw.decode()
    except UnicodeDecodeError:
        return None
    if not name:
        return None
    return (name, suffix[0]) if sep else (name, 0)


class Verdict(enum.Enum):
    """What :meth:`PathGuard.check` decided about one frame."""

    ACCEPT = "accept"  # new: deliver it
    DUPLICATE = "duplicate"  # a copy of an accepted frame that came by another path
    REPLAY = "replay"  # not newer than the last frame on its own path
    STALE = "stale"  # outside the time window, or older than what the guard remembers


_ACCEPT, _DUPLICATE, _REPLAY, _STALE = (
    Verdict.ACCEPT,
    Verdict.DUPLICATE,
    Verdict.REPLAY,
    Verdict.STALE,
)


@dataclass(slots=True)
class _Sender:
    high: int = -1  # highest accepted seq over all paths
    floor: int = -1  # highest seq forgotten: older unknown seqs cannot be proven new
    path_high: dict[Hashable, int] = field(default_factory=dict)
    recent: set[int] = field(default_factory=set)
    order: deque[int] = field(default_factory=deque)  # ``recent`` in arrival order


class PathGuard:
    """Replay protection and duplicate suppression for the paths of one socket group.

    A frame is identified by its sender and its ``seq`` (the sender's strictly
    increasing nanosecond clock). Per path, seqs must increase (a path is one
    ordered TCP connection): anything else is a :attr:`Verdict.REPLAY`. Across
    paths, frames may arrive in any order; the guard remembers the seqs it
    accepted (the last ``memory`` of them, and none older than the window) and
    calls a remembered one a :attr:`Verdict.DUPLICATE`. A seq below everything
    it remembers and not newer than the newest accepted one cannot be proven
    new, so it is :attr:`Verdict.STALE` (fail closed: never delivered twice).
    With one path per sender only the first two rules ever apply.

    Args:
        window_s: how far a frame's seq (a wall-clock time) may be from ours.
        memory: seqs remembered per sender for duplicate detection.
    """

    def __init__(self, window_s: float = 30.0, memory: int = K_DEDUP_MEMORY) -> None:
        if memory < 1:
            raise LocalProtocolError("dedup memory must be at least 1")
        self.window_ns = int(window_s * 1e9)
        self.memory = memory
        self._senders: dict[str, _Sender] = {}

    def check(self, src: str, path: Hashable, seq: int, now_ns: int | None = None) -> Verdict:
        """Judge frame ``seq`` from ``src`` that arrived on ``path``; record it if accepted."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        if abs(seq - now_ns) > self.window_ns:
            return _STALE
        st = self._senders.get(src)
        if st is None:
            st = self._senders[src] = _Sender()
        path_high = st.path_high
        if seq <= path_high.get(path, -1):
            return _REPLAY
        if seq <= st.high:
            if seq in st.recent:
                path_high[path] = seq  # this path has now carried it too
                return _DUPLICATE
            if seq <= st.floor:
                return _STALE
        else:
            st.high = seq
        path_high[path] = seq
        st.recent.add(seq)
        order = st.order
        order.append(seq)
        if len(order) > self.memory or order[0] < now_ns - self.window_ns:
            self._forget(st, now_ns - self.window_ns)
        return _ACCEPT

    def _forget(self, st: _Sender, horizon: int) -> None:
        """Drop the oldest seqs beyond ``memory`` or the time window; raise the floor."""
        order = st.order
        while len(order) > self.memory or order[0] < horizon:
            old = order.popleft()
            st.recent.discard(old)
            if old > st.floor:
                st.floor = old
