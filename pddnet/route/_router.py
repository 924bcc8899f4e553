"""Route choice and RLD admission control, sans-IO.

For each request the router picks one of the pipelines the architecture
allows, from what it costs to ship the request's KV delta to MD:

* ``P->MD`` when the delta arrives in time for the TTFT target on its own
  (high prefix-hit requests: the common case);
* ``P->RLD->MD`` when it does not: RLD masks the transfer with eager tokens
  and hands over by token ids;
* ``P->RLD`` (no WAN transfer at all) only with the strange-traffic policy
  option, when ``max_tokens`` ends before the KV could land anyway.

RLD admission control keeps the relay tier inside its limits (concurrent
relays, reserved eager tokens): an overloaded RLD sheds to ``P->MD``, which
costs TTFT but never collapses the relay (the oscillation the PDD source
warns about). Every decision carries its reason and the numbers behind it,
and is counted in :meth:`Router.statistics`.
"""

from __future__ import annotations

import enum
import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import LocalProtocolError

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


class Route(enum.Enum):
    """The pipelines a request may take."""

    P_MD = "p-md"
    P_RLD_MD = "p-rld-md"
    P_RLD = "p-rld"  # strange traffic only: the WAN transfer is skipped


class RouteReason(enum.Enum):
    """Why a route was chosen."""

    FITS_TTFT = "the delta reaches MD within the TTFT target"
    MASK_TRANSFER = "the delta misses the TTFT target: RLD masks it"
    SHORT_OUTPUT = "max_tokens ends before the KV could land: skip the WAN transfer"
    RELAY_FULL = "RLD is at its concurrent-relay limit: shed to P->MD"
    EAGER_BUDGET = "RLD's eager-token budget is spent: shed to P->MD"
    FORCED = "the caller chose the route"


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    """The WAN path as the router sees it (from the WAN transport's statistics).

    Args:
        bandwidth_bytes_s: goodput available to one transfer, bytes/s.
        rtt_s: round-trip time, seconds.
    """

    bandwidth_bytes_s: float
    rtt_s: float

    def transfer_s(self, nbytes: int) -> float:
        """Estimated time to land ``nbytes`` on MD: one RTT plus serialisation."""
        return self.rtt_s + nbytes / self.bandwidth_bytes_s


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """Router tuning.

    Args:
        ttft_target_s: default TTFT target when a request names none.
        md_first_token_s: MD's time from landed KV to the first token.
        rld_decode_rate: one relay's decode speed, tokens/s; turns a
            transfer time into the eager tokens RLD will generate.
        catchup_slack: tokens reserved per relay beyond the transfer time
            (the catch-up rounds); about the catch-up threshold.
        max_concurrent_relays: relays RLD may run at once.
        max_eager_tokens: eager tokens reserved across all relays.
        skip_wan_short_output: enable the strange-traffic cut-off at routing time.
        skip_factor: skip the WAN when ``max_tokens / rld_decode_rate`` is at
            most this fraction of the estimated transfer time.
        history: how many recent decisions :meth:`Router.decisions` keeps.
    """

    ttft_target_s: float = 2.0
    md_first_token_s: float = 0.05
    rld_decode_rate: float = 50.0
    catchup_slack: int = 64
    max_concurrent_relays: int = 32
    max_eager_tokens: int = 32 * 512
    skip_wan_short_output: bool = False
    skip_factor: float = 1.0
    history: int = 256

    def __post_init__(self) -> None:
        if self.rld_decode_rate <= 0 or self.ttft_target_s <= 0:
            raise ValueError("rld_decode_rate and ttft_target_s must be > 0")
        if self.max_concurrent_relays < 0 or self.max_eager_tokens < 0:
            raise ValueError("admission limits must be >= 0")


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router needs to know about one request.

    Args:
        request_id: the request.
        delta_bytes: KV bytes MD lacks (after its prefix cache), to ship over the WAN.
        max_tokens: the request's output limit.
        ttft_target_s: this request's TTFT target, or None for the policy's.
    """

    request_id: int
    delta_bytes: int
    max_tokens: int
    ttft_target_s: float | None = None


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """One routing decision and the numbers behind it.

    Attributes:
        route: the chosen pipeline.
        reason: why.
        transfer_s: the estimated WAN transfer time of the delta.
        eager_tokens: eager tokens reserved on RLD (0 on P->MD).
        at: when it was decided.
    """

    request_id: int
    route: Route
    reason: RouteReason
    transfer_s: float
    eager_tokens: int
    at: float

    @property
    def uses_rld(self) -> bool:
        """Whether the request holds an RLD slot until :meth:`Router.release`."""
        return self.route is not Route.P_MD

    @property
    def uses_wan(self) -> bool:
        """Whether P ships the KV delta to MD."""
        return self.route is not Route.P_RLD


@dataclass(frozen=True, slots=True)
class RouterStats:
    """A snapshot of the router's load and decision counts."""

    active_relays: int
    eager_reserved: int
    peak_relays: int
    peak_eager: int
    by_route: dict[str, int]
    by_reason: dict[str, int]
    link: LinkEstimate


class Router:
    """Sans-IO route choice with RLD admission control.

    Args:
        policy: tuning and limits.
        link: the initial WAN estimate; refresh it with :meth:`update_link`.
        on_decision: called with every :class:`RouteDecision` (logging, metrics).
    """

    def __init__(
        self,
        policy: RoutePolicy | None = None,
        link: LinkEstimate | None = None,
        *,
        on_decision: Callable[[RouteDecision], None] | None = None,
    ) -> None:
        self.policy = policy or RoutePolicy()
        self.link = link or LinkEstimate(bandwidth_bytes_s=1.25e9, rtt_s=0.03)
        self._on_decision = on_decision
        self._active: dict[int, int] = {}  # request id -> reserved eager tokens
        self._eager = 0
        self._peak_relays = 0
        self._peak_eager = 0
        self._by_route: Counter[str] = Counter()
        self._by_reason: Counter[str] = Counter()
        self._recent: deque[RouteDecision] = deque(maxlen=self.policy.history)

    def update_link(
        self,
        *,
        bandwidth_bytes_s: float | None = None,
        rtt_s: float | None = None,
        weight: float = 1.0,
    ) -> None:
        """Fold a new WAN measurement into the estimate.

        Args:
            bandwidth_bytes_s: measured goodput, if any.
            rtt_s: measured round trip, if any.
            weight: EWMA weight of the new sample (1.0 replaces the estimate).
        """
        bw, rtt = self.link.bandwidth_bytes_s, self.link.rtt_s
        if bandwidth_bytes_s is not None and bandwidth_bytes_s > 0:
            bw = (1 - weight) * bw + weight * bandwidth_bytes_s
        if rtt_s is not None and rtt_s >= 0:
            rtt = (1 - weight) * rtt + weight * rtt_s
        self.link = LinkEstimate(bw, rtt)

    def decide(self, request: RouteRequest, now: float) -> RouteDecision:
        """Choose the route of ``request`` and, for RLD routes, admit it.

        Args:
            request: the request's size and limits.
            now: the current time.

        Returns:
            The decision; if ``decision.uses_rld``, the caller must call
            :meth:`release` when RLD lets go of the request.

        Raises:
            LocalProtocolError: if the request id already holds an RLD slot.
        """
        if request.request_id in self._active:
            raise LocalProtocolError(
                "request already admitted to RLD", request_id=request.request_id
            )
        p = self.policy
        transfer = self.link.transfer_s(max(0, request.delta_bytes))
        target = request.ttft_target_s if request.ttft_target_s is not None else p.ttft_target_s
        eager = 0
        if transfer + p.md_first_token_s <= target:
            route, reason = Route.P_MD, RouteReason.FITS_TTFT
        else:
            short = request.max_tokens / p.rld_decode_rate <= p.skip_factor * transfer
            if p.skip_wan_short_output and short:
                want, why = Route.P_RLD, RouteReason.SHORT_OUTPUT
                eager = request.max_tokens
            else:
                want, why = Route.P_RLD_MD, RouteReason.MASK_TRANSFER
                eager = min(
                    request.max_tokens, math.ceil(transfer * p.rld_decode_rate) + p.catchup_slack
                )
            if len(self._active) >= p.max_concurrent_relays:
                route, reason, eager = Route.P_MD, RouteReason.RELAY_FULL, 0
            elif self._eager + eager > p.max_eager_tokens:
                route, reason, eager = Route.P_MD, RouteReason.EAGER_BUDGET, 0
            else:
                route, reason = want, why
        if route is not Route.P_MD:
            self._active[request.request_id] = eager
            self._eager += eager
            self._peak_relays = max(self._peak_relays, len(self._active))
            self._peak_eager = max(self._peak_eager, self._eager)
        decision = RouteDecision(request.request_id, route, reason, transfer, eager, now)
        self._by_route[route.value] += 1
        self._by_reason[reason.name] += 1
        self._recent.append(decision)
        if self._on_decision is not None:
            self._on_decision(decision)
        return decision

    def release(self, request_id: int) -> None:
        """RLD let go of ``request_id`` (released, finished, failed or cancelled).

        Releasing an unknown or already released id is a no-op, so drivers
        may call it from every exit path.
        """
        eager = self._active.pop(request_id, None)
        if eager is not None:
            self._eager -= eager

    @property
    def active_relays(self) -> int:
        """Requests holding an RLD slot now."""
        return len(self._active)

    def decisions(self) -> tuple[RouteDecision, ...]:
        """The most recent decisions, oldest first (``policy.history`` of them)."""
        return tuple(self._recent)

    def statistics(self) -> RouterStats:
        """A frozen snapshot of load, peaks and decision counts."""
        return RouterStats(
            len(self._active),
            self._eager,
            self._peak_relays,
            self._peak_eager,
            dict(self._by_route),
            dict(self._by_reason),
            self.link,
        )
