"""Leases on P's source blocks (sans-IO).

P must not reuse a request's source blocks while a transfer may still read
them. A lease holds them until every transfer of the request has finished,
or until the lease runs out because its receivers stopped renewing it (they
send :class:`~pddnet.api.LeaseRenew` while they receive). An expired lease
means a receiver died or hung: P cancels the transfers and frees the blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .._errors import LocalProtocolError

__all__ = ["Lease", "LeaseTable"]


@dataclass(slots=True)
class Lease:
    request_id: int
    blocks: tuple[int, ...]
    expires_at: float
    pending: set[str] = field(default_factory=set)  # destinations still transferring


class LeaseTable:
    """The leases of one prefill endpoint; time is a parameter.

    Args:
        duration_s: how long a lease lives without a renewal.
    """

    def __init__(self, duration_s: float = 10.0) -> None:
        self.duration_s = duration_s
        self._leases: dict[int, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._leases

    def acquire(
        self, request_id: int, blocks: tuple[int, ...], dests: set[str], now: float
    ) -> None:
        """Hold ``blocks`` for transfers to ``dests``.

        Raises:
            LocalProtocolError: if the request already holds a lease.
        """
        if request_id in self._leases:
            raise LocalProtocolError("request already holds a lease", request_id=request_id)
        self._leases[request_id] = Lease(request_id, blocks, now + self.duration_s, set(dests))

    def renew(self, request_id: int, now: float) -> bool:
        """Extend the lease; False if there is none (finished, expired or unknown)."""
        lease = self._leases.get(request_id)
        if lease is None:
            return False
        lease.expires_at = max(lease.expires_at, now + self.duration_s)
        return True

    def finish(self, request_id: int, dest: str) -> tuple[int, ...] | None:
        """A transfer to ``dest`` ended; returns the blocks to free once none is left."""
        lease = self._leases.get(request_id)
        if lease is None:
            return None
        lease.pending.discard(dest)
        if lease.pending:
            return None
        del self._leases[request_id]
        return lease.blocks

    def release(self, request_id: int) -> tuple[int, ...] | None:
        """Drop the lease now (abort); returns its blocks, or None if it had none."""
        lease = self._leases.pop(request_id, None)
        return None if lease is None else lease.blocks

    def expire(self, now: float) -> list[Lease]:
        """Remove and return every lease whose time ran out."""
        dead = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in dead:
            del self._leases[lease.request_id]
        return dead

    def next_expiry(self) -> float:
        return min((lease.expires_at for lease in self._leases.values()), default=math.inf)

    def held_blocks(self) -> int:
        return sum(len(lease.blocks) for lease in self._leases.values())
