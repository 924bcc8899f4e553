"""A set of disjoint half-open integer intervals, kept sorted and merged.

Used on both sides of a transfer: the receiver tracks *verified* logical bytes
(a duplicate chunk is one fully inside the set), the sender tracks bytes that
are *ready* to send. Operations are ``O(log n + k)`` with ``n`` intervals and
``k`` intervals touched; chunks mostly arrive in order, so ``n`` stays small.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

__all__ = ["IntervalSet"]


class IntervalSet:
    """Disjoint, merged ``[lo, hi)`` intervals."""

    __slots__ = ("_ends", "_starts", "total")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self.total = 0

    def __len__(self) -> int:
        return len(self._starts)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(zip(self._starts, self._ends, strict=True))

    def add(self, lo: int, hi: int) -> int:
        """Add ``[lo, hi)``; returns how many bytes were new."""
        if hi <= lo:
            return 0
        # intervals touching [lo, hi] (adjacent ones merge too)
        i = bisect_left(self._ends, lo)
        j = bisect_right(self._starts, hi)
        covered = 0
        new_lo, new_hi = lo, hi
        if i < j:
            new_lo = min(lo, self._starts[i])
            new_hi = max(hi, self._ends[j - 1])
            for k in range(i, j):
                covered += min(hi, self._ends[k]) - max(lo, self._starts[k])
            del self._starts[i:j]
            del self._ends[i:j]
        self._starts.insert(i, new_lo)
        self._ends.insert(i, new_hi)
        added = (hi - lo) - max(covered, 0)
        self.total += added
        return added

    def overlap(self, lo: int, hi: int) -> int:
        """Bytes of ``[lo, hi)`` inside the set."""
        i = bisect_right(self._ends, lo)
        n = 0
        while i < len(self._starts) and self._starts[i] < hi:
            n += min(hi, self._ends[i]) - max(lo, self._starts[i])
            i += 1
        return n

    def covers(self, lo: int, hi: int) -> bool:
        """Whether all of ``[lo, hi)`` is inside the set (true for an empty range)."""
        if hi <= lo:
            return True
        i = bisect_right(self._starts, lo) - 1
        return i >= 0 and self._ends[i] >= hi

    def first_gap(self, lo: int, hi: int) -> tuple[int, int] | None:
        """The first sub-range of ``[lo, hi)`` not in the set, or None."""
        pos = lo
        i = bisect_right(self._ends, pos)
        while pos < hi:
            if i >= len(self._starts) or self._starts[i] >= hi:
                return pos, hi
            if self._starts[i] > pos:
                return pos, self._starts[i]
            pos = self._ends[i]
            i += 1
        return None
