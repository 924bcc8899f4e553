"""Congestion-aware pacing of the WAN streams (sans-IO, pluggable).

A pacer sees one :class:`TcpSample` per stream every sampling period (read
from ``TCP_INFO`` by the driver) and returns a :class:`PacingDecision`: the
``SO_MAX_PACING_RATE`` to set on each stream (or None for unpaced) and how
many streams may take new chunks. It never touches a socket or a clock:
``now`` is an argument, so pacers are tested with synthetic traces.

Pacers are registered by name, as aioquic registers congestion controllers::

    register_pacer("mine", MyPacer)
    pacer = make_pacer("mine", max_streams=8, rate_cap=125e6)

Built in:

``fixed``
    The operator cap only: ``rate_cap / streams`` per stream, all streams on.
``adaptive`` (default)
    Keeps the aggregate below what the path delivers when the path shows
    *self-inflicted* trouble, and otherwise gets out of the way:

    * queueing: the median smoothed RTT over the streams that sent in the last
      period exceeds its own windowed minimum (the *RTT floor*) by more than
      ``queue_tolerance`` (relative) plus ``queue_slack`` (5 ms). The floor is
      the minimum of the per-period median smoothed RTT, not TCP's ``min_rtt``:
      with delay jitter, ``min_rtt`` is the luckiest packet (17 ms on a 30 ms
      path with 5 ms jitter per direction) while every smoothed RTT carries the
      jitter, so against ``min_rtt`` a jittery path reads as a permanent queue.
      Streams that sent less than ``min_sent`` (64 KiB) since the last decision
      (switched off, idle, only link frames) are ignored: their ``TCP_INFO``
      RTT is frozen at its last value, or left from the handshake;
    * loss storm: retransmitted bytes exceed ``storm_ratio`` of sent bytes in
      the last period *and* RTT is inflated, or exceed ``5 * storm_ratio``
      regardless. Random loss alone (0.1 %, flat RTT) is not congestion and
      leaves the rate alone: cutting it is exactly what makes cubic slow on
      lossy WAN paths.

    On queueing what the streams may send together (the target times the
    per-stream ``slack`` below) drops to ``backoff`` (0.95) times the bottleneck
    estimate (the windowed maximum of the summed delivery rates), so the
    standing queue drains while the link stays nearly full; on a loss
    storm to ``storm_backoff`` (0.8) times it, but not below ``min_fraction``
    (0.7) of the 10 s maximum (no downward spiral when losses continue whatever
    the rate); never below ``floor``. After ``calm_periods`` clean periods
    it grows by ``probe_gain`` (3 %) per period up to the cap, and is released
    (None) without a cap once it is far above what the path delivers.
    Cuts start once the aggregate delivery rate stops growing (by more than
    10 % per period) or after ``warmup`` (1 s), whichever is first: the
    delivery rate of a starting flow underestimates the path. If the
    "queue" does not drain within ``stuck_periods`` periods of being paced
    below the path, it is not self-inflicted (jitter, someone else's queue):
    the RTT floor is reset to the current RTT and the target grows again. This
    breaks the ratchet that held a jittered link at 2-27 MB/s (docs/wan.md).
    ("Paced below the path": the allowed aggregate, ``slack`` x target, is
    under 0.9 of the 10 s maximum delivery rate. A queue that persists while
    the pacing does not bind is ours and stays cut, as before.)

    **Startup drain.** A fresh sender's streams (eight BBR flows in STARTUP, each
    at 2.89x its share) overshoot together and leave a bottleneck queue of about
    one RTT, which every urgent chunk must cross (docs/wan.md, "Startup drain").
    For the first ``startup_window`` (2 s) of sending the pacer is asked every
    ``startup_interval`` (10 ms). The reference RTT is the median of the median
    smoothed RTTs seen so far in startup. The moment the median smoothed RTT
    exceeds it by ``max(queue_slack, startup_tolerance x ref)``, at least
    ``startup_min_rtts`` (3) reference RTTs after the first bytes, while the
    summed delivery rate has stopped growing (under ``plateau_growth`` x what it
    was one reference RTT earlier: the path is full), it paces the aggregate at
    ``drain_gain`` (0.5) x the peak delivery rate of the last 100 ms until the
    RTT is back within ``max(2 ms, 5 %)`` of the reference (at most
    ``max_drain_rtts`` reference RTTs), holds ``backoff`` x the highest summed
    delivery rate seen in startup for ``hold_rtts`` (10) reference RTTs so the
    flows leave STARTUP, then hands
    over to the rules above, started afresh (the overshoot's losses and RTTs
    are not theirs to react to; their RTT floor starts at the reference).
    Once only; not on paths whose reference RTT is under ``startup_min_rtt``
    (1 ms).

    Each stream gets ``slack`` (1.25) times its even share of the target: a
    stream in loss recovery cannot use its share and the others take it up
    (with ``slack = 1`` the aggregate fell to 0.90 of a 1 Gbit/s link; with 1.25
    it reached 0.966, docs/wan.md). The operator cap stays strict per stream. Streams are switched
    off when the per-stream share would fall below ``min_stream_rate``.
"""

from __future__ import annotations

import math
import statistics
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AdaptivePacer",
    "FixedPacer",
    "Pacer",
    "PacingDecision",
    "TcpSample",
    "UnsentMark",
    "available_pacers",
    "make_pacer",
    "register_pacer",
]


@dataclass(frozen=True, slots=True)
class TcpSample:
    """One stream's ``TCP_INFO`` reading (rates in bytes/s, times in seconds)."""

    stream: int
    rtt: float
    min_rtt: float
    delivery_rate: float
    bytes_sent: int
    bytes_retrans: int
    cwnd: int = 0
    pacing_rate: float = 0.0
    snd_wnd: int = 0  # the peer's advertised receive window, bytes (0: not reported)


@dataclass(frozen=True, slots=True)
class PacingDecision:
    """Per-stream max pacing rate in bytes/s (None = unpaced) and active stream count."""

    rate_per_stream: float | None
    active_streams: int


@dataclass(slots=True)
class UnsentMark:
    """Which ``TCP_NOTSENT_LOWAT`` the bulk streams use now (sans-IO).

    A high unsent mark means fewer, larger writes and wake-ups per chunk (less
    CPU), but an urgent chunk that a bulk stream pulls waits behind up to that
    many unsent bytes. So the bulk streams use ``high`` only while no urgent
    (``priority > 0``) transfer is queued or in flight, and ``low`` from the
    moment one is until ``hold`` seconds after the last one ended, so a train
    of urgent transfers with short gaps does not flip the mark back and forth.
    A bulk socket holding more than ``low`` unsent bytes when the mark drops is
    not writable until it has drained, so it pulls no urgent chunk meanwhile
    (the express stream serves them). docs/wan.md, "The unsent mark only while
    no urgent transfer runs". The sender's bulk chunk size follows the same
    state (:meth:`bulk_only`; docs/wan.md, "Larger chunks while no urgent
    transfer runs").

    Args:
        low: the mark with urgent transfers about (0: no mark at all, ever).
        high: the mark for bulk alone (at least ``low``).
        hold: seconds the mark stays ``low`` after the last urgent transfer ended.
    """

    low: int
    high: int
    hold: float
    _low_until: float = -math.inf  # inf while an urgent transfer runs

    def update(self, now: float, urgent: bool) -> int:
        """The mark to use at ``now``, given whether an urgent transfer runs."""
        if urgent:
            self._low_until = math.inf
        elif self._low_until == math.inf:  # the last urgent transfer ended now
            self._low_until = now + self.hold
        if not self.low or not self.bulk_only(now):
            return self.low
        return max(self.high, self.low)

    def bulk_only(self, now: float) -> bool:
        """Whether the bulk-alone settings apply at ``now``: no urgent transfer
        since ``hold`` seconds, as of the last :meth:`update` (even with
        ``low`` 0, which only means there is no mark to raise)."""
        return now >= self._low_until


class Pacer(ABC):
    """Base of pacers.

    Args:
        max_streams: streams the link has.
        rate_cap: operator cap on the aggregate rate, bytes/s (None = no cap).
    """

    def __init__(self, *, max_streams: int, rate_cap: float | None = None, **_: Any) -> None:
        self.max_streams = max_streams
        self.rate_cap = rate_cap

    @abstractmethod
    def on_sample(self, sample: TcpSample, now: float) -> None:
        """Feed one stream's reading."""

    @abstractmethod
    def decide(self, now: float) -> PacingDecision:
        """The pacing to apply from now on."""

    def sample_interval(self) -> float | None:
        """How soon the driver should sample and decide again; None: its default."""
        return None


_REGISTRY: dict[str, Callable[..., Pacer]] = {}


def register_pacer(name: str, factory: Callable[..., Pacer]) -> None:
    """Register a pacer class or factory under ``name`` (replacing any)."""
    _REGISTRY[name] = factory


def make_pacer(name: str, **kwargs: Any) -> Pacer:
    """Build the pacer registered as ``name``.

    Raises:
        ValueError: for an unknown name.
    """
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown pacer {name!r}; known: {sorted(_REGISTRY)}") from None
    return factory(**kwargs)


def available_pacers() -> list[str]:
    return sorted(_REGISTRY)


class FixedPacer(Pacer):
    """The operator cap, split evenly; all streams active."""

    def on_sample(self, sample: TcpSample, now: float) -> None:
        pass

    def decide(self, now: float) -> PacingDecision:
        rate = None if self.rate_cap is None else self.rate_cap / self.max_streams
        return PacingDecision(rate, self.max_streams)


class AdaptivePacer(Pacer):
    """Delay- and loss-aware aggregate pacing (see the module docstring)."""

    def __init__(
        self,
        *,
        max_streams: int,
        rate_cap: float | None = None,
        period: float = 0.2,
        queue_tolerance: float = 0.25,
        queue_slack: float = 0.005,
        storm_ratio: float = 0.02,
        backoff: float = 0.95,
        storm_backoff: float = 0.8,
        probe_gain: float = 1.03,
        bw_window: float = 2.0,
        long_window: float = 10.0,
        min_fraction: float = 0.7,
        calm_periods: int = 2,
        floor: float = 1e6,
        min_stream_rate: float = 1.25e6,
        min_rtt_window: float = 10.0,
        slack: float = 1.25,
        warmup: float = 1.0,
        stuck_periods: int = 10,
        startup_window: float = 2.0,
        startup_interval: float = 0.01,
        startup_tolerance: float = 0.15,
        startup_min_rtt: float = 1e-3,
        drain_gain: float = 0.5,
        max_drain_rtts: float = 4.0,
        hold_rtts: float = 10.0,
        plateau_growth: float = 1.25,
        startup_min_rtts: float = 3.0,
        min_sent: int = 64 << 10,
        **kw: Any,
    ) -> None:
        super().__init__(max_streams=max_streams, rate_cap=rate_cap)
        self.min_sent = min_sent
        self.startup_window = startup_window
        self.startup_interval = startup_interval
        self.startup_tolerance = startup_tolerance
        self.startup_min_rtt = startup_min_rtt
        self.drain_gain = drain_gain
        self.max_drain_rtts = max_drain_rtts
        self.hold_rtts = hold_rtts
        self.plateau_growth = plateau_growth
        self.startup_min_rtts = startup_min_rtts
        self._phase = "startup"  # -> ("drain" -> "hold" -> "handover" ->) "steady"
        self._sending_since: float | None = None
        self._ramp_rtts: list[float] = []
        self._ref_rtt = 0.0
        self._recent: deque[tuple[float, float]] = deque()  # (time, delivered), last 2 RTTs
        self._drain_at = 0.0
        self._drain_rate = 0.0
        self._peak = 0.0
        self.period = period
        self.queue_tolerance = queue_tolerance
        self.queue_slack = queue_slack
        self.storm_ratio = storm_ratio
        self.backoff = backoff
        self.storm_backoff = storm_backoff
        self.probe_gain = probe_gain
        self.bw_window = bw_window
        self.long_window = long_window
        self.min_fraction = min_fraction
        self._delivered_long: list[tuple[float, float]] = []
        self._delivered: list[tuple[float, float]] = []  # (time, aggregate delivery rate)
        self.calm_periods = calm_periods
        self.floor = floor
        self.min_stream_rate = min_stream_rate
        self.min_rtt_window = min_rtt_window
        self.slack = slack
        self.warmup = warmup
        self.stuck_periods = stuck_periods
        self._first_at: float | None = None
        self._warm = False
        self._prev_delivered = 0.0
        self._srtts: list[tuple[float, float]] = []  # (time, median srtt) window: the RTT floor
        self._queued = 0  # consecutive periods of queueing while paced
        self.target: float | None = rate_cap
        self._latest: dict[int, TcpSample] = {}
        self._prev: dict[int, TcpSample] = {}
        self._last_decision_at: float | None = None
        self._calm = 0
        self._decision = PacingDecision(self._per_stream(self.target), max_streams)
        self.trouble = ""  # last reason for a cut, for statistics
        # (now, target, median srtt, base rtt, delivered, event) per decision, for benchmarks
        self.history: deque[tuple[float, float | None, float, float, float, str]] = deque(
            maxlen=1000
        )

    def _per_stream(self, total: float | None) -> float | None:
        return None if total is None else total / self.max_streams

    def on_sample(self, sample: TcpSample, now: float) -> None:
        self._latest[sample.stream] = sample
        if self._first_at is None:
            self._first_at = now

    def _sending(self) -> list[TcpSample]:
        """Latest samples of the streams that sent at least ``min_sent`` bytes since
        the previous decision (a new or reconnected stream: since it connected).

        A stream that carried only link frames (its hello, an ack's worth) says
        nothing about the path: one that had just connected, with a smoothed RTT
        of 0.918 s left from its handshake and 0.29 MB/s delivered, once read as
        a 30x queue, and the cut to ``floor`` took 3 s to grow back (docs/wan.md
        "Slow runs")."""
        out = []
        for s in self._latest.values():
            p = self._prev.get(s.stream)
            since = p.bytes_sent if p is not None and s.bytes_sent >= p.bytes_sent else 0
            if s.bytes_sent - since >= self.min_sent:
                out.append(s)
        return out

    def sample_interval(self) -> float | None:
        return None if self._phase == "steady" else self.startup_interval

    def decide(self, now: float) -> PacingDecision:
        if self._phase != "steady":
            drain = self._startup(now)
            if drain is not None:
                return drain  # the rules below wait: what they would see is the drain's
            if self._phase == "handover":
                # start them afresh: no loss ratio or target from the overshoot
                self._phase = "steady"
                self._prev = dict(self._latest)
                self._last_decision_at = now
                # the RTT floor restarts at the reference measured under load: a
                # floor from the idle handshake sits under a jittered path's every
                # smoothed RTT, and the cuts it causes now bind (see queueing)
                self._srtts = [(now, self._ref_rtt)]
                self.target = self.rate_cap
                self._decision = PacingDecision(self._per_stream(self.target), self.max_streams)
                return self._decision
        return self._decide(now)

    def _startup(self, now: float) -> PacingDecision | None:
        """The startup drain (see the module docstring): its pacing, or None."""
        samples = list(self._latest.values())
        if self._sending_since is None:
            if not any(s.bytes_sent for s in samples):
                return None
            self._sending_since = now
        rtts = [s.rtt for s in samples if s.rtt > 0]
        if not rtts:
            return None
        srtt = statistics.median(rtts)
        delivered = sum(s.delivery_rate for s in samples)
        self._peak = max(self._peak, delivered)  # the most the path carried: the hold's base
        self._recent.append((now, delivered))
        while now - self._recent[0][0] > max(0.1, 2 * self._ref_rtt):
            self._recent.popleft()
        if self._phase == "startup":
            # the reference: the median RTT while the flows ramp up (not the
            # minimum: on a jittered path every smoothed RTT carries the jitter)
            self._ramp_rtts.append(srtt)
            ref = self._ref_rtt = statistics.median(self._ramp_rtts)
            if ref < self.startup_min_rtt or now - self._sending_since > self.startup_window:
                self._phase = "steady"
                return None
            if srtt <= ref + max(self.queue_slack, self.startup_tolerance * ref):
                return None
            if now - self._sending_since < self.startup_min_rtts * ref:
                # the first window's burst queues briefly on a slow path, and the
                # first RTTs' delivery rates read low (13.8 MB/s on a 25 MB/s link,
                # and the hold then kept the flows at half the path)
                return None
            # a queue of ours only once the path is full: the delivery rate has
            # stopped growing over the last RTT (a jittered path shows "queueing"
            # while the flows are still far below it; draining then starved them)
            before = [d for t, d in self._recent if t <= now - ref]
            if not before or delivered > self.plateau_growth * max(before):
                return None
            self._phase, self._drain_at = "drain", now
            peak = max(d for t, d in self._recent if t > now - 0.1)
            self._drain_rate = max(self.drain_gain * peak, self.floor)
            self.history.append((now, self._drain_rate, srtt, ref, delivered, "drain"))
        ref = self._ref_rtt
        if self._phase == "drain":
            drained = srtt <= ref + max(0.002, 0.05 * ref)
            if drained or now - self._drain_at > self.max_drain_rtts * ref:
                # hold just under the path until the flows have left STARTUP: let
                # go at once and they overshoot again (measured: the queue was
                # back within 3 RTTs)
                self._phase, self._drain_at = "hold", now
                self._drain_rate = self.backoff * self._peak
                self.history.append((now, self._drain_rate, srtt, ref, delivered, "drained"))
        elif now - self._drain_at > self.hold_rtts * ref:
            self._phase = "handover"
            self.history.append((now, self.rate_cap, srtt, ref, delivered, "held"))
            return None
        rate = self._drain_rate / self.max_streams
        if self.rate_cap is not None:
            rate = min(rate, self.rate_cap / self.max_streams)
        return PacingDecision(rate, self.max_streams)

    def _decide(self, now: float) -> PacingDecision:
        if self._last_decision_at is not None and now - self._last_decision_at < self.period:
            return self._decision
        self._last_decision_at = now
        samples = self._sending()
        if not samples:
            return self._decision
        srtt = statistics.median(s.rtt for s in samples)
        self._srtts = [(t, r) for t, r in self._srtts if now - t <= self.min_rtt_window]
        if srtt > 0:
            self._srtts.append((now, srtt))
        base = min((r for _, r in self._srtts), default=0.0)
        delivered = sum(s.delivery_rate for s in samples)
        self._delivered = [(t, d) for t, d in self._delivered if now - t <= self.bw_window]
        self._delivered.append((now, delivered))
        bw = max(d for _, d in self._delivered)  # bottleneck estimate: windowed max
        self._delivered_long = [
            (t, d) for t, d in self._delivered_long if now - t <= self.long_window
        ]
        self._delivered_long.append((now, delivered))
        bw_long = max(d for _, d in self._delivered_long)
        sent = retrans = 0
        for s in samples:
            p = self._prev.get(s.stream)
            if p is not None and s.bytes_sent >= p.bytes_sent:
                sent += s.bytes_sent - p.bytes_sent
                retrans += max(s.bytes_retrans - p.bytes_retrans, 0)
        self._prev = dict(self._latest)
        ratio = retrans / sent if sent else 0.0
        queueing = base > 0 and srtt > base * (1 + self.queue_tolerance) + self.queue_slack
        # the pacing binds: it allows clearly less than the path delivered lately
        binding = self.target is not None and self.target * self.slack < 0.9 * bw_long
        if queueing and binding:
            self._queued += 1
            if self._queued >= self.stuck_periods:
                # paced below the path for stuck_periods and the RTT did not come
                # down: not our queue. Take the current RTT as the floor again.
                self._srtts = [(now, srtt)]
                base, queueing, self._queued = srtt, False, 0
        else:
            self._queued = 0
        storm = (ratio > self.storm_ratio and queueing) or ratio > 5 * self.storm_ratio
        if not self._warm:
            self._warm = (self._first_at is not None and now - self._first_at >= self.warmup) or (
                0 < delivered <= 1.1 * self._prev_delivered
            )
            self._prev_delivered = delivered
        if (queueing or storm) and delivered > 0 and self._warm:
            self.trouble = "loss storm" if storm else "queueing"
            # queueing: pace just under the bottleneck, so the queue drains but the
            # link stays full; a loss storm: cut harder, below what got through
            if storm:
                # Once paced, what is delivered is what we allow: cutting again from
                # it spirals down when losses go on whatever the rate (seen at 0 ms
                # RTT behind a drop-tail queue). The long-window maximum bounds it.
                cut = max(self.storm_backoff * bw, self.min_fraction * bw_long)
            else:
                # what the streams may send together (target x slack) goes under
                # the bottleneck: with the slack on top, a cut to backoff x bw still
                # allowed 1.19x the path, and a standing queue of one RTT (eight
                # BBR flows' 2 x BDP in flight) never drained (docs/wan.md)
                cut = self.backoff * bw / self.slack
            cut = max(cut, self.floor)
            self.target = cut if self.target is None else min(self.target, cut)
            self._calm = 0
        else:
            self._calm += 1
            if self.target is not None and self._calm >= self.calm_periods:
                grown = max(self.target, delivered) * self.probe_gain
                if self.rate_cap is not None:
                    self.target = min(grown, self.rate_cap)
                else:
                    # released once it clearly exceeds what the path delivers
                    self.target = None if grown > 4 * max(delivered, self.floor) else grown
        if self.rate_cap is not None:
            self.target = min(self.target or self.rate_cap, self.rate_cap)
        event = ("storm" if storm else "queue") if (queueing or storm) else ""
        self.history.append((now, self.target, srtt, base, delivered, event))
        active = self.max_streams
        if self.target is not None:
            active = max(1, min(self.max_streams, int(self.target // self.min_stream_rate)))
        rate = None
        if self.target is not None:
            # per-stream slack: a stream in loss recovery cannot use its share, so
            # the others may exceed theirs; the operator cap stays strict
            rate = self.target / active * self.slack
            if self.rate_cap is not None:
                rate = min(rate, self.rate_cap / active)
        self._decision = PacingDecision(rate, active)
        return self._decision


register_pacer("fixed", FixedPacer)
register_pacer("adaptive", AdaptivePacer)
