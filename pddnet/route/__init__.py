"""Route choice (P->MD or P->RLD->MD), the strange-traffic cut-off and RLD
admission control, sans-IO. See docs/handoff.md, "Routing"."""

from ._router import (
    LinkEstimate,
    Route,
    RouteDecision,
    RoutePolicy,
    Router,
    RouteReason,
    RouteRequest,
    RouterStats,
)

__all__ = [
    "LinkEstimate",
    "Route",
    "RouteDecision",
    "RoutePolicy",
    "RouteReason",
    "RouteRequest",
    "Router",
    "RouterStats",
]
