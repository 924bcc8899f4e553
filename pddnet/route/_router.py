"""Route choice across instances and RLD admission control, sans-IO.

For each request the router picks one of the pipelines the architecture
allows, from what it costs to ship the request's KV delta to MD:

* ``P->MD`` when the delta arrives in time for the TTFT target on its own
  (high prefix-hit requests: the common case);
* ``P->RLD->MD`` when it does not: RLD masks the transfer with eager tokens
  and hands over by token ids;
* ``P->RLD`` (no WAN transfer at all) only with the strange-traffic policy
  option, when ``max_tokens`` ends before the KV could land anyway.

Across instances (theory of operation)
--------------------------------------
The caller describes every instance the request may use as plain data
(:class:`MainCandidate`, :class:`RelayCandidate`): nothing here reads a
socket, a directory or a clock, so a driver, a cluster test and the
simulator run the same decisions from the same inputs.

1. **Which MD.** Each MD's delta lands at
   ``rtt + (bytes_ahead + delta_bytes) / bandwidth`` with that MD's own link
   estimate (:meth:`Router.link_for`): ``delta_bytes`` is what that MD lacks
   (prefix affinity: the MD whose cache holds most of the prompt has the
   smallest delta; blocks still in flight to it are not in its cache yet, so
   they count in the delta) and ``bytes_ahead`` is what P's WAN sender to it
   sends first (the WAN queue, with the scheduler's priorities). An MD
   without a completed transfer to measure its link gets the shared estimate
   (:attr:`Router.link`) divided among the flows on it: itself and every
   other candidate with bytes queued. The request then waits for that MD's
   decode batch: ``md_load_s * active / capacity`` more (a full batch adds
   ``md_load_s``; nothing when the capacity is unknown). The MD with the
   smallest expected wait, landing plus batch, wins; MDs within ``tie_s`` of
   it count as equal and the least loaded of those wins (then the one
   holding more of the prompt, then the one with less queued, then the
   name). An MD at its capacity is passed over unless all are.
2. **Which pipeline**, from the winner's estimate, as for one MD: P->MD when
   ``transfer_s + md_first_token_s`` fits the TTFT target, else a relay route.
3. **Which RLD.** Admission control keeps each RLD inside its limits
   (concurrent relays, counting those its candidate entry says other P
   instances hold, and eager tokens reserved by this router). Among the RLDs
   that admit the request the least loaded wins (then fewer eager tokens,
   then the name). When none admits, or none is connected, the request is
   shed to ``P->MD``: it costs TTFT but never collapses the relay tier (the
   oscillation the PDD source warns about).

Every decision records each candidate with the numbers the router saw and a
:class:`Verdict` (why it won or lost), and is counted in
:meth:`Router.statistics`. Without candidates (``mains``/``relays`` None)
the router sees one unnamed MD with ``RouteRequest.delta_bytes`` and one
unnamed RLD, as for a single-instance deployment.
"""

from __future__ import annotations

import enum
import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .._errors import LocalProtocolError

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
    NO_RELAY = "no RLD is connected: shed to P->MD"
    FORCED = "the caller chose the route"


class Verdict(enum.Enum):
    """What the router concluded about one candidate instance."""

    CHOSEN = "chosen"
    LANDS_LATER = "MD: its expected wait (landing plus batch) exceeds the winner's by over tie_s"
    MORE_LOADED = "within tie_s of the winner, but more loaded (or later in the order)"
    AT_CAPACITY = "MD: at its capacity while another is not"
    RELAY_LIMIT = "RLD: at its concurrent-relay limit"
    EAGER_LIMIT = "RLD: the reservation would exceed its eager-token budget"
    NOT_NEEDED = "RLD: the route does not use a relay"


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    """The WAN path as the router sees it (from the WAN transport's statistics).

    Args:
        bandwidth_bytes_s: goodput of the path to one MD, bytes/s.
        rtt_s: round-trip time, seconds.
    """

    bandwidth_bytes_s: float
    rtt_s: float

    def transfer_s(self, nbytes: int, ahead: int = 0) -> float:
        """Estimated time to land ``nbytes`` on MD behind ``ahead`` bytes the
        sender sends first: one RTT plus serialisation of both."""
        return self.rtt_s + (ahead + nbytes) / self.bandwidth_bytes_s


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
        max_concurrent_relays: relays one RLD may run at once.
        max_eager_tokens: eager tokens reserved across one RLD's relays.
        skip_wan_short_output: enable the strange-traffic cut-off at routing time.
        skip_factor: skip the WAN when ``max_tokens / rld_decode_rate`` is at
            most this fraction of the estimated transfer time.
        history: how many recent decisions :meth:`Router.decisions` keeps.
        tie_s: MDs whose expected waits are within this many seconds of the
            smallest count as equal, and load decides between them.
        md_load_s: what a full decode batch adds to a new request's wait at
            MD (``active / capacity`` of it for a partly full one): the
            price in landing time of sending a request to a busier MD.
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
    tie_s: float = 0.001
    md_load_s: float = 0.05

    def __post_init__(self) -> None:
        if self.rld_decode_rate <= 0 or self.ttft_target_s <= 0:
            raise ValueError("rld_decode_rate and ttft_target_s must be > 0")
        if self.max_concurrent_relays < 0 or self.max_eager_tokens < 0:
            raise ValueError("admission limits must be >= 0")
        if self.tie_s < 0 or self.md_load_s < 0:
            raise ValueError("tie_s and md_load_s must be >= 0")


@dataclass(frozen=True, slots=True)
class MainCandidate:
    """One MD the request may go to, as P sees it now.

    Args:
        name: the MD endpoint's name.
        delta_bytes: KV bytes of the prompt this MD lacks: the prompt's bytes
            less the leading blocks P's mirror of its cache holds
            (:meth:`~pddnet.cache.CacheMirror.predict`). Blocks still in
            flight to it are not in its cache yet and count here.
        bytes_ahead: bytes P's WAN sender to this MD sends before a new
            transfer of ``delta_bytes`` (:meth:`~pddnet.transport.wan.WanSender.bytes_ahead`).
        active: requests in progress on it (its load), as far as P knows.
        capacity: requests it takes at once; 0 for no known limit.
    """

    name: str
    delta_bytes: int
    bytes_ahead: int = 0
    active: int = 0
    capacity: int = 0


@dataclass(frozen=True, slots=True)
class RelayCandidate:
    """One RLD the request may relay on.

    Args:
        name: the RLD endpoint's name.
        active: relays it runs for other prefill instances (from the
            directory's load); this router's own reservations are added.
    """

    name: str
    active: int = 0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router needs to know about one request.

    Args:
        request_id: the request.
        delta_bytes: KV bytes MD lacks (after its prefix cache), to ship over
            the WAN, when ``mains`` is None (one unnamed MD); with candidates,
            each carries its own and this is not read.
        max_tokens: the request's output limit.
        ttft_target_s: this request's TTFT target, or None for the policy's.
        mains: the MDs it may go to (at least one), or None for one unnamed MD.
        relays: the RLDs it may relay on (may be empty: then no relay route),
            or None for one unnamed RLD.
        route: force this pipeline (reason ``FORCED``): the router still
            picks the MD and, for a relay route, the least loaded RLD, but
            admits nothing (no slot is held; :meth:`Router.release` is a no-op).
    """

    request_id: int
    delta_bytes: int
    max_tokens: int
    ttft_target_s: float | None = None
    mains: tuple[MainCandidate, ...] | None = None
    relays: tuple[RelayCandidate, ...] | None = None
    route: Route | None = None


@dataclass(frozen=True, slots=True)
class Candidate:
    """One instance the router weighed for a request, and its verdict (see
    :attr:`RouteDecision.candidates`).

    Attributes:
        name: the instance.
        role: ``"main"`` or ``"relay"``.
        verdict: why it won or lost.
        transfer_s: MD: the estimated time for its delta to land (queue
            included); RLD: 0.
        delta_bytes: MD: the bytes it lacks; RLD: 0.
        bytes_ahead: MD: the bytes queued ahead at P's sender to it; RLD: 0.
        active: its load when the router looked (RLD: other instances'
            relays plus this router's).
    """

    name: str
    role: str
    verdict: Verdict
    transfer_s: float = 0.0
    delta_bytes: int = 0
    bytes_ahead: int = 0
    active: int = 0


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """One routing decision and the numbers behind it.

    Attributes:
        route: the chosen pipeline.
        reason: why.
        transfer_s: the estimated WAN transfer time of the delta to the chosen
            MD, the bytes queued ahead of it included.
        eager_tokens: eager tokens reserved on RLD (0 on P->MD).
        at: when it was decided.
        main: the chosen MD ("" for the unnamed one).
        relay: the chosen RLD ("" on P->MD, or for the unnamed one).
        delta_bytes: the bytes the chosen MD lacks.
        bytes_ahead: the bytes queued ahead of them at P's sender.
        mains, relays: the candidates as the router got them.
        estimates: each MD's estimated landing time (``transfer_s``), as ``mains``.
        relay_loads: each RLD's relays as the router counted them (its
            candidate's ``active`` plus this router's), as ``relays``.
        verdicts: each candidate's :class:`Verdict`, MDs then RLDs.
    """

    request_id: int
    route: Route
    reason: RouteReason
    transfer_s: float
    eager_tokens: int
    at: float
    main: str = ""
    relay: str = ""
    delta_bytes: int = 0
    bytes_ahead: int = 0
    mains: tuple[MainCandidate, ...] = ()
    relays: tuple[RelayCandidate, ...] = ()
    estimates: tuple[float, ...] = ()
    relay_loads: tuple[int, ...] = ()
    verdicts: tuple[Verdict, ...] = ()

    @property
    def uses_rld(self) -> bool:
        """Whether the request holds an RLD slot until :meth:`Router.release`."""
        return self.route is not Route.P_MD

    @property
    def uses_wan(self) -> bool:
        """Whether P ships the KV delta to MD."""
        return self.route is not Route.P_RLD

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        """Every instance weighed, MDs first, with the numbers and its verdict
        (built on demand: the decision keeps them as parallel tuples)."""
        n = len(self.mains)
        return tuple(
            Candidate(c.name, "main", v, t, c.delta_bytes, c.bytes_ahead, c.active)
            for c, t, v in zip(self.mains, self.estimates, self.verdicts[:n], strict=True)
        ) + tuple(
            Candidate(c.name, "relay", v, active=load)
            for c, load, v in zip(self.relays, self.relay_loads, self.verdicts[n:], strict=True)
        )


@dataclass(frozen=True, slots=True)
class RouterStats:
    """A snapshot of the router's load and decision counts.

    ``active_relays``, ``eager_reserved`` and the peaks are totals over every
    RLD; ``by_relay`` is each RLD's relays now, ``by_main`` the decisions
    that went to each MD, ``links`` the per-MD estimates (``link`` is the
    default for an MD without one).
    """

    active_relays: int
    eager_reserved: int
    peak_relays: int
    peak_eager: int
    by_route: dict[str, int]
    by_reason: dict[str, int]
    link: LinkEstimate
    by_relay: dict[str, int] = field(default_factory=dict)
    by_main: dict[str, int] = field(default_factory=dict)
    links: dict[str, LinkEstimate] = field(default_factory=dict)


_ONE_RELAY = (RelayCandidate(""),)


class Router:
    """Sans-IO route choice across MD and RLD instances, with RLD admission control.

    Args:
        policy: tuning and limits.
        link: the initial WAN estimate, and the default for an MD without an
            estimate of its own; refresh with :meth:`update_link`.
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
        self.links: dict[str, LinkEstimate] = {}
        self._on_decision = on_decision
        self._active: dict[int, tuple[str, int]] = {}  # request id -> (relay, eager tokens)
        self._relays: dict[str, list[int]] = {}  # relay -> [relays held, eager tokens]
        self._eager = 0
        self._peak_relays = 0
        self._peak_eager = 0
        self._by_route: Counter[str] = Counter()
        self._by_reason: Counter[str] = Counter()
        self._by_main: Counter[str] = Counter()
        self._recent: deque[RouteDecision] = deque(maxlen=self.policy.history)

    def link_for(self, main: str, flows: int = 1) -> LinkEstimate:
        """The WAN estimate to MD ``main``: its own once a transfer to it
        was measured; until then the shared :attr:`link`, its bandwidth
        divided among the ``flows`` that use it (this one included)."""
        own = self.links.get(main)
        if own is not None:
            return own
        link = self.link
        return link if flows <= 1 else LinkEstimate(link.bandwidth_bytes_s / flows, link.rtt_s)

    def update_link(
        self,
        *,
        bandwidth_bytes_s: float | None = None,
        rtt_s: float | None = None,
        weight: float = 1.0,
        main: str | None = None,
    ) -> None:
        """Fold a new WAN measurement into an estimate.

        Args:
            bandwidth_bytes_s: measured goodput, if any.
            rtt_s: measured round trip, if any.
            weight: EWMA weight of the new sample (1.0 replaces the estimate).
            main: the MD it was measured to; None updates the default
                :attr:`link` (a one-MD deployment, or every MD without its own).
        """
        old = self.link if main is None else self.link_for(main)
        bw, rtt = old.bandwidth_bytes_s, old.rtt_s
        if bandwidth_bytes_s is not None and bandwidth_bytes_s > 0:
            bw = (1 - weight) * bw + weight * bandwidth_bytes_s
        if rtt_s is not None and rtt_s >= 0:
            rtt = (1 - weight) * rtt + weight * rtt_s
        if main is None:
            self.link = LinkEstimate(bw, rtt)
        else:
            self.links[main] = LinkEstimate(bw, rtt)

    def forget(self, name: str) -> None:
        """An instance left (the directory said so): drop its link estimate.
        Its relays stay counted until each is released."""
        self.links.pop(name, None)

    def decide(self, request: RouteRequest, now: float) -> RouteDecision:
        """Choose the MD, the route and (for RLD routes) the RLD of
        ``request``, and admit it there.

        Args:
            request: the request's size, limits and candidate instances.
            now: the current time.

        Returns:
            The decision; if ``decision.uses_rld``, the caller must call
            :meth:`release` when RLD lets go of the request.

        Raises:
            LocalProtocolError: if the request id already holds an RLD slot,
                ``mains`` is empty, or a forced relay route has no RLD.
        """
        rid = request.request_id
        if rid in self._active:
            raise LocalProtocolError("request already admitted to RLD", request_id=rid)
        p = self.policy
        mains = request.mains
        if mains is None:
            mains = (MainCandidate("", request.delta_bytes),)
        elif not mains:
            raise LocalProtocolError("no MD candidate to route to", request_id=rid)
        times, win, verdicts = self._pick_main(mains)
        transfer = times[win]
        best = mains[win]
        target = request.ttft_target_s if request.ttft_target_s is not None else p.ttft_target_s
        relays = _ONE_RELAY if request.relays is None else request.relays
        loads = [c.active + self._held(c.name) for c in relays]
        rverdicts = [Verdict.NOT_NEEDED] * len(relays)
        eager = 0
        relay = -1
        if request.route is not None:
            route, reason = request.route, RouteReason.FORCED
            if route is not Route.P_MD:
                if not relays:
                    raise LocalProtocolError(
                        f"no RLD candidate for the forced route {route.value}", request_id=rid
                    )
                relay = self._pick_relay(relays, loads, 0, rverdicts, admit=False)
        elif transfer + p.md_first_token_s <= target:
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
            relay = self._pick_relay(relays, loads, eager, rverdicts)
            if relay >= 0:
                route, reason = want, why
            else:
                if not relays:
                    reason = RouteReason.NO_RELAY
                elif Verdict.EAGER_LIMIT in rverdicts:
                    reason = RouteReason.EAGER_BUDGET
                else:
                    reason = RouteReason.RELAY_FULL
                route, eager = Route.P_MD, 0
        relay_name = relays[relay].name if relay >= 0 else ""
        if relay >= 0 and reason is not RouteReason.FORCED:
            self._active[rid] = (relay_name, eager)
            held = self._relays.setdefault(relay_name, [0, 0])
            held[0] += 1
            held[1] += eager
            self._eager += eager
            self._peak_relays = max(self._peak_relays, len(self._active))
            self._peak_eager = max(self._peak_eager, self._eager)
        decision = RouteDecision(
            rid,
            route,
            reason,
            transfer,
            eager,
            now,
            best.name,
            relay_name,
            best.delta_bytes,
            best.bytes_ahead,
            mains,
            relays,
            tuple(times),
            tuple(loads),
            (*verdicts, *rverdicts),
        )
        self._by_route[route.value] += 1
        self._by_reason[reason.name] += 1
        self._by_main[best.name] += 1
        self._recent.append(decision)
        if self._on_decision is not None:
            self._on_decision(decision)
        return decision

    def _pick_main(
        self, mains: tuple[MainCandidate, ...]
    ) -> tuple[list[float], int, list[Verdict]]:
        """(each MD's landing estimate, the winner's index, each MD's verdict)."""
        busy = sum(1 for c in mains if c.bytes_ahead > 0)  # flows on the shared link
        times, waits = [], []
        load_s = self.policy.md_load_s
        links, shared = self.links, self.link
        for c in mains:
            own = links.get(c.name)  # else link_for's split, inline: this is the hot path
            if own is not None:
                bw, rtt = own.bandwidth_bytes_s, own.rtt_s
            else:
                bw = shared.bandwidth_bytes_s / max(1, busy + (c.bytes_ahead <= 0))
                rtt = shared.rtt_s
            landed = rtt + (max(0, c.bytes_ahead) + max(0, c.delta_bytes)) / bw
            times.append(landed)
            waits.append(landed + (load_s * c.active / c.capacity if c.capacity else 0.0))
        open_ = [i for i, c in enumerate(mains) if not c.capacity or c.active < c.capacity]
        pool = open_ or range(len(mains))
        limit = min(waits[i] for i in pool) + self.policy.tie_s
        tied = [i for i in pool if waits[i] <= limit]
        win = tied[0]
        if len(tied) > 1:

            def load(i: int) -> tuple[float, int, int, str]:
                c = mains[i]
                share = c.active / c.capacity if c.capacity else 0.0
                return (share, c.delta_bytes, c.bytes_ahead, c.name)

            win = min(tied, key=load)
        verdicts = [Verdict.LANDS_LATER] * len(mains)
        if len(open_) < len(mains) and open_:
            for i, c in enumerate(mains):
                if c.capacity and c.active >= c.capacity:
                    verdicts[i] = Verdict.AT_CAPACITY
        for i in tied:
            verdicts[i] = Verdict.MORE_LOADED
        verdicts[win] = Verdict.CHOSEN
        return times, win, verdicts

    def _held(self, relay: str) -> int:
        held = self._relays.get(relay)
        return held[0] if held else 0

    def _pick_relay(
        self,
        relays: tuple[RelayCandidate, ...],
        loads: list[int],
        eager: int,
        verdicts: list[Verdict],
        *,
        admit: bool = True,
    ) -> int:
        """The index of the least loaded RLD that admits ``eager`` tokens
        (any, with ``admit`` false), or -1; ``verdicts`` gets each one's."""
        p = self.policy
        best, best_key = -1, (0, 0, "")
        for i, c in enumerate(relays):
            held = self._relays.get(c.name)
            reserved = held[1] if held else 0
            if admit and loads[i] >= p.max_concurrent_relays:
                verdicts[i] = Verdict.RELAY_LIMIT
            elif admit and reserved + eager > p.max_eager_tokens:
                verdicts[i] = Verdict.EAGER_LIMIT
            else:
                verdicts[i] = Verdict.MORE_LOADED
                key = (loads[i], reserved, c.name)
                if best < 0 or key < best_key:
                    best, best_key = i, key
        if best >= 0:
            verdicts[best] = Verdict.CHOSEN
        return best

    def release(self, request_id: int) -> None:
        """RLD let go of ``request_id`` (released, finished, failed or cancelled).

        Releasing an unknown or already released id is a no-op, so drivers
        may call it from every exit path.
        """
        entry = self._active.pop(request_id, None)
        if entry is None:
            return
        relay, eager = entry
        self._eager -= eager
        held = self._relays[relay]
        held[0] -= 1
        held[1] -= eager
        if not held[0]:
            del self._relays[relay]

    @property
    def active_relays(self) -> int:
        """Requests holding an RLD slot now, over every RLD."""
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
            {name: held[0] for name, held in self._relays.items()},
            dict(self._by_main),
            dict(self.links),
        )
