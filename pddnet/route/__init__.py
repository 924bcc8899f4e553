"""Route choice (which MD, P->MD or P->RLD->MD, which RLD), the
strange-traffic cut-off and RLD admission control, sans-IO. See
docs/handoff.md, "Routing", and docs/cluster.md, "Routing across instances"."""

from ._router import (
    Candidate,
    LinkEstimate,
    MainCandidate,
    RelayCandidate,
    Route,
    RouteDecision,
    RoutePolicy,
    Router,
    RouteReason,
    RouteRequest,
    RouterStats,
    Verdict,
)

__all__ = [
    "Candidate",
    "LinkEstimate",
    "MainCandidate",
    "RelayCandidate",
    "Route",
    "RouteDecision",
    "RoutePolicy",
    "RouteReason",
    "RouteRequest",
    "Router",
    "RouterStats",
    "Verdict",
]
