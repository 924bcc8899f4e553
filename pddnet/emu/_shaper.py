"""Sans-IO model of one direction of the emulated WAN link.

Theory of operation
-------------------
A packet offered at time ``now`` goes through, in order:

1. **Bottleneck queue** (if ``rate`` is set). The transmitter is modelled by one
   number, ``link_free``: the time it finishes serialising the last accepted
   packet. The bytes still waiting at ``now`` are ``(link_free - now) * rate``;
   if this backlog plus the packet exceeds ``queue_bytes`` the packet is dropped
   (drop-tail). Otherwise it departs at ``max(now, link_free) + size / rate``.
   This is exact for a FIFO served at a constant rate, and needs no timer.
2. **Wire loss**: Gilbert-Elliott state step, then the random and bursty loss
   draws. Loss happens after the queue, so lost packets used link time, as on a
   real lossy wire. Every packet draws the same number of random numbers from
   the seeded stream, so a given packet sequence always loses the same packets.
3. **Delay line**: due = departure + delay + jitter (normal, truncated at 3
   sigma, never below the departure time). Unless ``allow_reorder``, due times
   never decrease (a packet waits for the one ahead of it), so jitter does not
   reorder. With probability ``reorder`` a packet skips the delay line and is
   due at its departure time: it overtakes the packets in flight.

The driver (the TUN forwarder) calls :meth:`DirectionShaper.push` for each packet
it reads, and :meth:`DirectionShaper.pop_due` when :meth:`next_due` has passed.
Times are plain floats in seconds from any monotonic clock.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections import deque
from dataclasses import dataclass

from ._spec import LinkSpec

__all__ = ["DirectionShaper", "ShaperStats"]


@dataclass(slots=True)
class ShaperStats:
    """Counters of one direction (mutable; copy with :meth:`snapshot`)."""

    packets_in: int = 0
    bytes_in: int = 0
    packets_out: int = 0
    bytes_out: int = 0
    lost: int = 0
    queue_drops: int = 0
    reordered: int = 0
    max_backlog_bytes: int = 0

    def snapshot(self) -> dict[str, int]:
        """A plain dict copy."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class DirectionShaper:
    """Delay, jitter, loss, rate and queue of one link direction (sans-IO).

    Args:
        spec: the direction's parameters.
        rtt: round-trip time used for the default queue size (one BDP).
    """

    def __init__(self, spec: LinkSpec, *, rtt: float | None = None) -> None:
        self.spec = spec
        self.stats = ShaperStats()
        self._rng = random.Random(spec.seed)
        self._rate_Bps = spec.rate / 8.0 if spec.rate else 0.0
        self._qlimit = spec.effective_queue_bytes(rtt)
        self._link_free = 0.0
        self._last_due = 0.0
        self._ge_bad = False
        self._seq = 0
        self._ordered = not (spec.allow_reorder or spec.reorder > 0)
        self._fifo: deque[tuple[float, bytes]] = deque()
        self._heap: list[tuple[float, int, bytes]] = []

    @property
    def queue_limit(self) -> int:
        """The drop-tail limit in bytes."""
        return self._qlimit

    def push(self, packet: bytes, now: float) -> float | None:
        """Offer a packet to the link.

        Args:
            packet: the IP packet.
            now: the current time.

        Returns:
            The time the packet is due at the far end, or ``None`` if it was dropped
            (queue overflow or wire loss).
        """
        spec = self.spec
        st = self.stats
        size = len(packet)
        st.packets_in += 1
        st.bytes_in += size
        depart = now
        if self._rate_Bps:
            start = self._link_free if self._link_free > now else now
            backlog = (start - now) * self._rate_Bps
            if backlog + size > self._qlimit:
                st.queue_drops += 1
                return None
            if backlog > st.max_backlog_bytes:
                st.max_backlog_bytes = int(backlog)
            depart = start + size / self._rate_Bps
            self._link_free = depart
        rng = self._rng
        lost = False
        ge = spec.ge
        if ge is not None:
            u = rng.random()
            if self._ge_bad:
                if u < ge.r:
                    self._ge_bad = False
            elif u < ge.p:
                self._ge_bad = True
            if rng.random() < (ge.loss_bad if self._ge_bad else ge.loss_good):
                lost = True
        if spec.loss > 0.0 and rng.random() < spec.loss:
            lost = True
        if lost:
            st.lost += 1
            return None
        due = depart + spec.delay
        if spec.jitter > 0.0:
            j = rng.gauss(0.0, spec.jitter)
            lim = 3.0 * spec.jitter
            due += -lim if j < -lim else (lim if j > lim else j)
            if due < depart:
                due = depart
        if spec.reorder > 0.0 and rng.random() < spec.reorder:
            due = depart
            st.reordered += 1
        elif not spec.allow_reorder:
            if due < self._last_due:
                due = self._last_due
            self._last_due = due
        if self._ordered:
            self._fifo.append((due, packet))
        else:
            self._seq += 1
            heapq.heappush(self._heap, (due, self._seq, packet))
        return due

    def next_due(self) -> float | None:
        """When the earliest held packet is due, or ``None`` if none is held."""
        if self._ordered:
            return self._fifo[0][0] if self._fifo else None
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[tuple[float, bytes]]:
        """Remove and return the packets due at or before ``now``, in delivery order.

        Args:
            now: the current time.

        Returns:
            ``(due, packet)`` pairs.
        """
        out: list[tuple[float, bytes]] = []
        if self._ordered:
            fifo = self._fifo
            while fifo and fifo[0][0] <= now:
                out.append(fifo.popleft())
        else:
            heap = self._heap
            while heap and heap[0][0] <= now:
                due, _, pkt = heapq.heappop(heap)
                out.append((due, pkt))
        st = self.stats
        st.packets_out += len(out)
        st.bytes_out += sum(len(p) for _, p in out)
        return out

    def __len__(self) -> int:
        return len(self._fifo) if self._ordered else len(self._heap)
