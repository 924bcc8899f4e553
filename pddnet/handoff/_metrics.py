"""Per-request metrics, combined from both sides of a handoff."""

from __future__ import annotations

from dataclasses import dataclass

from ._main import MainStats
from ._relay import RelayStats

__all__ = ["RequestMetrics", "combine_metrics"]


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """What one request cost and how it looked to the user.

    Attributes:
        request_id: the request.
        route: the route chosen ("p-md", "p-rld-md", "p-rld"), if known.
        route_reason: why the router chose it, if known.
        tokens_rld: tokens RLD emitted.
        tokens_md: tokens MD emitted.
        rounds: handoff batches (final switch included).
        max_gap_s: the largest user-visible inter-token gap (the stall),
            across both sides; assumes both stats share one clock (as in
            tests and single-host runs; otherwise measure at the stream sink).
        rld_occupancy_s: time the request held RLD.
        fallback: why catch-up was abandoned, if it was.
    """

    request_id: int
    route: str | None
    route_reason: str | None
    tokens_rld: int
    tokens_md: int
    rounds: int
    max_gap_s: float
    rld_occupancy_s: float
    fallback: str | None


def combine_metrics(
    relay: RelayStats | None,
    main: MainStats | None,
    *,
    route: str | None = None,
    route_reason: str | None = None,
) -> RequestMetrics:
    """Merge the RLD and MD snapshots of one request into :class:`RequestMetrics`.

    Args:
        relay: RLD's snapshot, or None on the P->MD route.
        main: MD's snapshot, or None if the request never reached MD.
        route: the route's name, from the router's decision.
        route_reason: the decision's reason.

    Returns:
        The request's metrics.

    Raises:
        ValueError: if both snapshots are None or belong to different requests.
    """
    if relay is None and main is None:
        raise ValueError("need at least one side's statistics")
    if relay is not None and main is not None and relay.request_id != main.request_id:
        raise ValueError("statistics of different requests")
    rid = relay.request_id if relay is not None else main.request_id  # type: ignore[union-attr]
    gap = max(relay.max_gap_s if relay else 0.0, main.max_gap_s if main else 0.0)
    if relay and main and relay.last_emit_at is not None and main.first_emit_at is not None:
        gap = max(gap, main.first_emit_at - relay.last_emit_at)
    return RequestMetrics(
        request_id=rid,
        route=route,
        route_reason=route_reason,
        tokens_rld=relay.tokens if relay else 0,
        tokens_md=main.tokens if main else 0,
        rounds=relay.rounds if relay else 0,
        max_gap_s=gap,
        rld_occupancy_s=relay.occupancy_s if relay else 0.0,
        fallback=relay.fallback if relay else None,
    )
