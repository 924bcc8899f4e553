"""The discrete-event simulation of one cluster run.

Time is simulated: events sit in a heap ordered by (time, sequence) and run
one at a time; nothing sleeps, nothing touches a socket. The simulation is
the *drivers* of pddnet's sans-IO parts, written against a simulated clock
and simulated engines and links, and fed the way pddnet's trio drivers feed
them:

* P (:class:`~pddnet.api.PrefillEndpoint`'s ``submit``): the prompt's chain keys go through each
  MD's :class:`~pddnet.cache.CacheMirror` (``expire``, ``predict``) to size the delta that MD lacks
  (each mirror starts from its MD's snapshot, and counts a prompt's blocks as held once its transfer
  completed, ``expect``, as ``PrefillEndpoint._watch`` does); P's :class:`~pddnet.route.Router` gets
  a :class:`~pddnet.route.MainCandidate` per MD (delta, the bytes queued ahead at P's sender to it,
  its load) and a :class:`~pddnet.route.RelayCandidate` per RLD (the relays other P's hold on it),
  decides MD, route and RLD (``decide``), is told when RLD lets go (``release``) and what a large
  WAN transfer measured (``update_link(main=...)``);
* MD (``CachedGrants``): the offer's prompt is matched and pinned on MD's
  :class:`~pddnet.cache.RadixCache` (what ``CacheServer.handle_plan`` does
  after decoding the prompt's varints, which the simulation skips), blocks
  are taken from MD's pool, evicting the cache's LRU blocks when short, and
  the prompt is cached at the request's end (``CacheServer.complete``'s
  insert and unpin); :meth:`~pddnet.cache.CacheServer.events` numbers the
  tree's changes, which reach P's mirrors one WAN one-way delay later;
* the WAN: each (P, MD) sender is a real :class:`~pddnet.transport.wan.Scheduler`
  whose streams pull chunks (``next_chunk``) and get acknowledgements
  (``on_ack``) from the link model;
* the handoff: one :class:`~pddnet.handoff.RelayHandoff` and one
  :class:`~pddnet.handoff.MainHandoff` per request, fed ``TokenGenerated``,
  ``KvLanded``, peer messages (through
  :func:`~pddnet.handoff.event_for_message`), ``RecomputeDone`` and ``Timer``
  at their ``get_timer()``; their outputs (``Emit``, ``SendMessage``,
  ``StartRecompute``, ``TakeOver``, ``CancelTransfer``, ``FreeBlocks``,
  ``Done``) are acted on as ``HandoffDriver`` does.

What is modelled rather than run: engine forward passes (:class:`EngineModel`),
the link (:class:`WanModel`), P's own prefix cache (it holds each session's
previous prompt) and the choice of P (sticky per session). MD's machine is
fed the first token it emits and the last one; the tokens between them only
advance the engine's step counter (the machine does nothing with them but
emit).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..cache import CacheMirror, CacheServer, Match, RadixCache, block_hashes
from ..handoff import (
    AbortReason,
    CancelTransfer,
    Done,
    Emit,
    Event,
    Fallback,
    FinishReason,
    FreeBlocks,
    HandoffMode,
    HandoffParams,
    KvLanded,
    MainHandoff,
    Output,
    RecomputeDone,
    RelayHandoff,
    SendMessage,
    StartRecompute,
    TakeOver,
    Timer,
    TokenGenerated,
    event_for_message,
)
from ..route import (
    LinkEstimate,
    MainCandidate,
    RelayCandidate,
    Route,
    RouteDecision,
    RoutePolicy,
    Router,
    RouteRequest,
)
from ..transport.wan import Scheduler, TransferCompleted, TransferFailed
from ..wire import Message
from ._config import SimConfig, SimConfigError
from ._models import EngineModel, HardwareModel, WanModel
from ._workload import K_SESSION_STRIDE, Turn, Workload, session_tokens

__all__ = ["RequestResult", "RunResult", "Simulation"]

K_BANDWIDTH_SAMPLE_BYTES = 1 << 20  # as PrefillEndpoint: smaller transfers measure the RTT
K_UNLIMITED = 1 << 40

_push = heapq.heappush


class EventLoop:
    """A heap of timed callbacks; :meth:`run` executes them in time order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0

    @property
    def events(self) -> int:
        """Events run so far."""
        return self._seq - len(self._heap)

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at simulated time ``when`` (never before now)."""
        self._seq += 1
        if when < self.now:
            when = self.now
        _push(self._heap, (when, self._seq, fn, args))

    def run(self) -> None:
        """Run every event, including those the events schedule."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            when, _, fn, args = pop(heap)
            self.now = when
            fn(*args)


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one simulated request did (times in simulated seconds)."""

    session: int
    turn: int
    prompt: int
    new_tokens: int
    output: int
    route: str
    reason: str
    arrival: float
    prefilled: float | None
    kv_landed: float | None
    first_token: float | None  # at the user's stream (cluster.sink)
    finished: float | None
    rld_tokens: int
    md_tokens: int
    wan_bytes: int
    md_hit_blocks: int
    handoff_stall_s: float | None
    rounds: int
    failure: str | None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.finished is None:
            return None
        return (self.finished - self.first_token) / max(1, self.output - 1)


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run: its requests, and the load and traffic behind them."""

    mode: str
    requests: list[RequestResult]
    makespan_s: float
    gpus: dict[str, int]
    cost_per_hour: float
    busy_s: dict[str, float]
    wan_bytes: int
    wan_bytes_resent: int
    router: dict[str, dict[str, int]]
    events: int
    md_cache_hit_rate: float
    mirror_overpredicted_blocks: int


class _Req:
    __slots__ = (
        "arrival",
        "base",
        "cursor",
        "decision",
        "end",
        "failure",
        "first_at",
        "freed",
        "hit_blocks",
        "keep",
        "keys",
        "landed",
        "landed_at",
        "main",
        "match",
        "md",
        "md_member",
        "md_timer",
        "md_tokens",
        "nblocks",
        "owned",
        "p",
        "plan_id",
        "prefilled",
        "relay",
        "relay_idx",
        "released",
        "rid",
        "rld_member",
        "rld_timer",
        "rld_tokens",
        "stall",
        "takeover",
        "tokens",
        "turn",
        "wan_bytes",
    )

    def __init__(self, rid: int, turn: Turn, arrival: float) -> None:
        self.rid = rid
        self.turn = turn
        self.arrival = arrival
        self.base = (turn.session + 1) * K_SESSION_STRIDE + turn.prompt  # output position 0's id
        self.p = self.md = self.relay_idx = -1
        self.decision: RouteDecision | None = None
        self.relay: RelayHandoff | None = None
        self.main: MainHandoff | None = None
        self.first_at: float | None = None
        self.end: float | None = None
        self.failure: str | None = None
        self.rld_tokens = self.md_tokens = 0
        self.wan_bytes = 0
        self.nblocks = self.hit_blocks = 0
        self.plan_id: int | None = None
        self.match: Match | None = None
        self.owned: list[int] = []
        self.landed = self.freed = self.released = False
        self.keep = False  # MD keeps a transfer RLD no longer needs (keep_strange_traffic)
        self.prefilled: float | None = None
        self.landed_at: float | None = None
        self.md_member = self.rld_member = False
        self.md_timer: float | None = None
        self.rld_timer: float | None = None
        self.stall: float | None = None
        self.takeover = 0
        self.tokens: Any = None  # the prompt's ids, from P's submit to MD's free
        self.keys: list[int] = []  # their full blocks' chain keys
        self.cursor: tuple[list[Turn], int] = ([], 0)

    def token(self, position: int) -> int:
        return self.base + position

    def finish_at(self, position: int) -> FinishReason | None:
        return FinishReason.EOS if position == self.turn.output - 1 else None


class _Engine:
    """One GPU's decode engine: continuous batching, one forward pass at a time.

    Members decode one token per step. RLD's members are *ticking*: each step
    feeds their machine a token, so RLD runs step by step. MD's are not (the
    step at which each one ends is known when it joins), so MD runs
    *segments*: the steps up to the next member's end, timed in closed form
    (:meth:`EngineModel.decode_steps_s`); a join or a recompute that arrives
    meanwhile cuts the segment at the end of the step in progress, as a real
    engine takes new work between steps. Extend passes (MD's recomputes) run
    alone between steps, or, with ``batch_tails``, ride in the next step.
    """

    def __init__(
        self, sim: Simulation, model: EngineModel, max_batch: int, batch_tails: bool
    ) -> None:
        self.sim = sim
        self.model = model
        self.max_batch = max_batch
        self.batch_tails = batch_tails
        self.members: dict[int, tuple[_Req, int, int]] = {}  # rid -> (req, join ctx, join step)
        self.ticking: dict[int, _Req] = {}
        self.finish: dict[int, list[_Req]] = {}  # step -> non-ticking members ending at it
        self.waiting: deque[tuple[_Req, int, int]] = deque()  # (req, ctx, remaining or -1)
        self.extends: deque[tuple[_Req, int, int]] = deque()  # (req, start, tokens)
        self.step = 0
        self.ctx = 0
        self.busy = False
        self.busy_s = 0.0
        self.tokens = 0
        # the steps in progress: (start time, steps, batch, context at start, extends riding)
        self._seg: tuple[float, int, int, int, list[tuple[_Req, int]]] | None = None
        self._gen = 0

    @property
    def load(self) -> int:
        return len(self.members) + len(self.waiting)

    def join(self, req: _Req, ctx: int, remaining: int) -> None:
        """Add ``req`` at context ``ctx``; ``remaining`` tokens to go, or -1 (ticking)."""
        # a pass in progress does not produce a token for it: it waits for the next
        self.waiting.append((req, ctx, remaining))
        self._new_work()

    def extend(self, req: _Req, start: int, tokens: int) -> None:
        """Queue an extend pass over ``tokens`` tokens of ``req`` from ``start``."""
        self.extends.append((req, start, tokens))
        self._new_work()

    def leave(self, req: _Req) -> None:
        """Remove a ticking member (its machine may no longer decode)."""
        entry = self.members.pop(req.rid, None)
        if entry is None:
            self.waiting = deque(w for w in self.waiting if w[0] is not req)
            return
        _, ctx, joined = entry
        self.ctx -= ctx + (self.step - joined)
        self.ticking.pop(req.rid, None)
        if not self.busy:
            self._admit()

    def _add(self, req: _Req, ctx: int, remaining: int) -> None:
        self.members[req.rid] = (req, ctx, self.step)
        self.ctx += ctx
        if remaining < 0:
            self.ticking[req.rid] = req
        else:
            self.finish.setdefault(self.step + remaining, []).append(req)

    def _admit(self) -> None:
        while self.waiting and len(self.members) < self.max_batch:
            self._add(*self.waiting.popleft())

    def _new_work(self) -> None:
        if not self.busy:
            self._admit()
            self._kick()
            return
        seg = self._seg
        if seg is None or seg[1] <= 1:
            return  # an extend pass or a single step: the work waits for its end
        t0, k, n, ctx0, riding = seg
        elapsed = self.sim.loop.now - t0
        lo, hi = 0, k - 1  # steps completed by now: the largest j with T(j) <= elapsed
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.model.decode_steps_s(n, ctx0, mid) <= elapsed:
                lo = mid
            else:
                hi = mid - 1
        cut = lo + 1
        if cut < k:
            self._start(t0, cut, n, ctx0, riding)

    def _start(
        self, t0: float, k: int, n: int, ctx0: int, riding: list[tuple[_Req, int]], dt: float = -1
    ) -> None:
        self.busy = True
        self._gen += 1
        self._seg = (t0, k, n, ctx0, riding)
        if dt < 0:
            dt = self.model.decode_steps_s(n, ctx0, k)
        self.sim.loop.at(t0 + dt, self._segment_done, self._gen)

    def _kick(self) -> None:
        if self.busy:
            return
        now = self.sim.loop.now
        if self.extends and not self.batch_tails:
            req, start, k = self.extends.popleft()
            dt = self.model.extend_s(k, req.turn.prompt + start)
            self.busy = True
            self.busy_s += dt
            self.sim.loop.at(now + dt, self._extend_done, req, start + k)
        elif self.extends:  # batch_tails: every pending extend rides in one step
            riding = [(r, s + k) for r, s, k in self.extends]
            k_all = sum(k for _, _, k in self.extends)
            ectx = sum(r.turn.prompt + s for r, s, _ in self.extends)
            dt = self.model.step_with_extend_s(
                len(self.members), self.ctx, k_all, ectx, len(self.extends)
            )
            self.extends.clear()
            self._start(now, 1, len(self.members), self.ctx, riding, dt)
        elif self.members:
            k = 1 if self.ticking else min(self.finish) - self.step
            self._start(now, k, len(self.members), self.ctx, [])

    def _extend_done(self, req: _Req, end: int) -> None:
        self.busy = False
        self.sim.recompute_done(req, end)
        self._admit()
        self._kick()

    def _segment_done(self, gen: int) -> None:
        if gen != self._gen or self._seg is None:
            return  # a segment that was cut
        t0, k, n, _, riding = self._seg
        self._seg = None
        self.busy = False
        self.busy_s += self.sim.loop.now - t0
        self.step += k
        self.ctx += n * k
        self.tokens += n * k
        for req in list(self.ticking.values()):
            if req.rid in self.ticking:
                self.sim.relay_token(req)
        for req in self.finish.pop(self.step, ()):
            _, ctx, joined = self.members.pop(req.rid)
            self.ctx -= ctx + (self.step - joined)
            self.sim.main_last_token(req)
        for req, end in riding:
            self.sim.recompute_done(req, end)
        self._admit()
        self._kick()


@dataclass(eq=False)
class _Prefill:
    model: EngineModel
    queue: deque[_Req] = field(default_factory=deque)
    busy: bool = False
    busy_s: float = 0.0


class _Sender:
    """One P's WAN sender: a real Scheduler, its streams, the link model."""

    def __init__(self, sim: Simulation, p: int, md: int) -> None:
        self.sim = sim
        self.p = p
        self.md = md
        w = sim.cfg.wan
        self.sched = Scheduler(  # as WanSender builds it, at the simulation's chunk sizes
            w.chunk_bytes, min_chunk=w.min_chunk_bytes, max_copies=2 if w.hedge else 1
        )
        self.sched.active_streams = w.streams
        self.hedge = w.hedge
        # idle streams, the longest idle first: WanSender's idle stream tasks
        # all wake on a change and trio runs them in no set order, so the
        # chunk goes to any of them, not to the one that sent last (which
        # matters with wan.slow_start_after_idle: that one's window is open)
        self.idle: deque[int] = deque(range(w.streams))
        self.last_sent = [-math.inf] * w.streams  # when each stream last sent (a new one: never)
        self.reqs: dict[int, tuple[_Req, float]] = {}  # transfer id -> (request, started)
        self.received: dict[int, int] = {}
        self.delivered: set[tuple[int, int]] = set()
        self.pump_at: float | None = None

    def start(self, req: _Req, nbytes: int) -> None:
        now = self.sim.loop.now
        self.reqs[req.rid] = (req, now)
        self.received[req.rid] = 0
        self.sched.add_transfer(req.rid, nbytes, deadline=now + self.sim.cfg.wan.timeout_s)
        if nbytes:
            self.sched.mark_ready(req.rid, 0, nbytes)
        else:  # nothing to ship: MD learns it with the accept's answer
            self.sim.loop.at(now + self.sim.wan.one_way_s, self.sim.kv_landed, req)
        self._drain()
        self.pump()

    def cancel(self, rid: int) -> None:
        self.sched.cancel(rid)
        self._drain()

    def pump(self) -> None:
        """Let every idle stream pull a chunk, as the sender's stream tasks do."""
        sim, sched = self.sim, self.sched
        now = sim.loop.now
        while self.idle:
            stream = self.idle[0]
            ch = sched.next_chunk(stream, now)
            if ch is None:
                break
            self.idle.popleft()
            sim.sending += 1
            rate = sim.wan.stream_rate(sim.sending)
            dt = sim.wan.send_s(ch.length, rate, now - self.last_sent[stream])
            self.last_sent[stream] = now + dt
            sim.loop.at(now + dt, self._stream_free, stream)
            arrive = now + dt + sim.wan.one_way_s + abs(sim.rng.gauss(0.0, sim.cfg.wan.jitter_s))
            sim.loop.at(arrive, self._deliver, stream, ch.transfer_id, ch.lo, ch.hi)
        if self.pump_at is not None and not self.hedge:
            # Without hedging the timer is the earliest deadline, and a new
            # transfer's deadline is never earlier than those before it.
            return
        when = sched.get_timer(self.idle[0] if self.idle else None)
        if when is not None and when > now and (self.pump_at is None or when < self.pump_at):
            self.pump_at = when
            sim.loop.at(when, self._timer_pump, when)

    def _timer_pump(self, when: float) -> None:
        if self.pump_at != when:
            return  # superseded by an earlier one
        self.pump_at = None
        self.sched.handle_timer(self.sim.loop.now)
        self._drain()
        self.pump()

    def _stream_free(self, stream: int) -> None:
        self.sim.sending -= 1
        self.idle.append(stream)
        self.pump()

    def _deliver(self, stream: int, tid: int, lo: int, hi: int) -> None:
        sim = self.sim
        back = sim.loop.now + sim.wan.one_way_s
        if (tid, lo) in self.delivered:
            sim.loop.at(back, self.sched.on_dup, stream, tid, lo, hi)
            return
        self.delivered.add((tid, lo))
        sim.loop.at(back, self._ack, stream, tid, lo, hi)
        entry = self.reqs.get(tid)
        if entry is None:
            return  # cancelled: the receiver drops it
        got = self.received[tid] = self.received[tid] + hi - lo
        if got == entry[0].wan_bytes:
            sim.kv_landed(entry[0])

    def _ack(self, stream: int, tid: int, lo: int, hi: int) -> None:
        self.sched.on_ack(stream, tid, lo, hi, self.sim.loop.now)
        self.delivered.discard((tid, lo))
        self._drain()
        if self.hedge:  # an ack frees a chunk's copies: an idle stream may hedge another
            self.pump()

    def _drain(self) -> None:
        for ev in self.sched.events():
            if isinstance(ev, TransferCompleted | TransferFailed):
                entry = self.reqs.pop(ev.transfer_id, None)
                self.received.pop(ev.transfer_id, None)
                if entry is None:
                    continue
                req, started = entry
                if isinstance(ev, TransferCompleted):
                    self.sim.transfer_completed(req, started)
                else:
                    self.sim.transfer_failed(req)


class Simulation:
    """One simulated run of a cluster under a workload.

    Args:
        cfg: the configuration.
        workload: the sessions to serve.
        baseline: route every request P->MD (no RLD role: the baseline).
    """

    def __init__(self, cfg: SimConfig, workload: Workload, *, baseline: bool = False) -> None:
        if cfg.cluster.relay == 0 and not baseline:
            raise SimConfigError("PDD needs at least one RLD GPU", key="cluster.relay")
        self.cfg = cfg
        self.workload = workload
        self.baseline = baseline
        self.loop = EventLoop()
        self.rng = random.Random(cfg.workload.seed * 7919 + 1)
        self.wan = WanModel(cfg.wan)
        self.hardware = HardwareModel(cfg)
        m, e, c = cfg.model, cfg.engine, cfg.cluster
        inst = self.hardware.instances(baseline)
        self.prefills = [_Prefill(EngineModel(m, cfg.gpu[g], e)) for g in inst["prefill"]]
        self.relays = [
            _Engine(self, EngineModel(m, cfg.gpu[g], e), e.rld_max_batch, False)
            for g in inst["relay"]
        ]
        md_models = [EngineModel(m, cfg.gpu[g], e) for g in inst["main"]]
        self.mains = [_Engine(self, em, e.md_max_batch, e.batch_tails) for em in md_models]
        self.block = c.kv_block_tokens
        self.block_bytes = c.kv_block_tokens * m.kv_bytes_per_token
        pool_blocks = [em.kv_pool_tokens(e.memory_reserve) // self.block for em in md_models]
        self.free_blocks = [list(range(n)) for n in pool_blocks]
        self.servers = [
            CacheServer(RadixCache(self.block), epoch=i + 1) for i in range(len(self.mains))
        ]
        self.mirrors = [
            CacheMirror(self.block, bytes_per_token=m.kv_bytes_per_token) for _ in self.mains
        ]
        # P connects before the run: each mirror starts from its MD's snapshot
        # (PrefillEndpoint.connect_peer asks for one), so it knows MD's epoch
        # and MD's first event does not void what P expects
        for server, mirror in zip(self.servers, self.mirrors, strict=True):
            for part in server.snapshot():
                mirror.apply(part)
        self.params = self._handoff_params(md_models[0])
        self.routers = [self._router() for _ in self.prefills]
        self.senders: dict[tuple[int, int], _Sender] = {}  # (P, MD) -> P's sender to MD
        self.main_names = [f"md{i}" for i in range(len(self.mains))]
        self.relay_names = [f"rld{i}" for i in range(len(self.relays))]
        self._index = {
            n: i for names in (self.main_names, self.relay_names) for i, n in enumerate(names)
        }
        # relays each P's router holds on each RLD (what the directory would
        # tell the other P instances), and their sum per RLD
        self.held = [[0] * len(self.relays) for _ in self.prefills]
        self.relay_slots = [0] * len(self.relays)
        self.md_active = [0] * len(self.mains)
        # per MD: when the mirror's last expectation (CacheMirror.expect) lapses
        self._expect_until = [-math.inf] * len(self.mains)
        self.sending = 0
        self.results: list[RequestResult] = []
        self._rid = 0
        self._keep = cfg.handoff.keep_strange_traffic
        # the hop from the decoder that emits a token to the user's stream:
        # none at the decoder; with the sink on P (as PrefillEndpoint's token
        # sink), RLD's tokens cross DC-A and MD's the WAN
        at_p = c.sink == "prefill"
        self._sink_rld = c.local_rtt_s / 2 if at_p else 0.0
        self._sink_md = self.wan.one_way_s if at_p else 0.0
        # per running session: its longest prompt's token ids, their chain
        # keys (array and list); every turn's prompt is a prefix of it, so its
        # ids and full-block keys are slices (block_hashes is a chain)
        self._streams: dict[int, tuple[Any, Any, list[int]]] = {}

    # ------------------------------------------------------------- policies
    def _relay_model(self) -> EngineModel:
        c = self.cfg.cluster
        return EngineModel(self.cfg.model, self.cfg.gpu[c.relay_gpu], self.cfg.engine)

    def rld_decode_rate(self) -> float:
        """The router's per-relay decode rate: as configured, or an RLD step at
        half its batch with 16K tokens of context each ("auto")."""
        rate = self.cfg.router.rld_decode_rate
        if not isinstance(rate, str):
            return float(rate)
        b = max(1, self.cfg.engine.rld_max_batch // 2)
        return 1.0 / self._relay_model().decode_step_s(b, b * 16384)

    def _router(self) -> Router:
        r = self.cfg.router
        # Per RLD: the relay count covers every P's relays (RelayCandidate.active),
        # the eager budget this router's own reservations (as the Router counts them).
        relays, eager = K_UNLIMITED, K_UNLIMITED
        if r.admission:
            relays, eager = r.max_concurrent_relays, r.max_eager_tokens
        try:
            policy = RoutePolicy(
                ttft_target_s=r.ttft_target_s,
                md_first_token_s=r.md_first_token_s,
                rld_decode_rate=self.rld_decode_rate(),
                catchup_slack=r.catchup_slack,
                max_concurrent_relays=relays,
                max_eager_tokens=eager,
            )
        except ValueError as exc:
            raise SimConfigError(str(exc), key="router") from exc
        link = r.link_bandwidth_bytes_s
        if isinstance(link, str):  # "auto": what one sender gets on the idle link
            link = self.wan.single_transfer_bytes_s()
        return Router(policy, LinkEstimate(float(link), self.cfg.wan.rtt_s))

    def _handoff_params(self, md: EngineModel) -> HandoffParams:
        h = self.cfg.handoff
        rate = h.recompute_rate
        if isinstance(rate, str):
            rate = 64 / md.extend_s(64, 16384)
        try:
            return HandoffParams(
                mode=HandoffMode(h.mode),
                catchup_threshold=h.catchup_threshold,
                final_switch_size=h.final_switch_size,
                min_batch=h.min_batch,
                max_rounds=h.max_rounds,
                recompute_rate=float(rate),
                rtt_s=self.cfg.wan.rtt_s,
                fallback=Fallback(h.fallback),
                max_stall_s=h.max_stall_s,
            )
        except ValueError as exc:
            raise SimConfigError(str(exc), key="handoff") from exc

    # ------------------------------------------------------------ arrivals
    def run(self) -> RunResult:
        """Serve the whole workload; return every request's result."""
        for turns in self.workload.sessions:
            if turns:
                self.loop.at(turns[0].delay_s, self._arrive, turns, 0)
        self.loop.run()
        return self._result()

    def _arrive(self, turns: list[Turn], k: int) -> None:
        turn = turns[k]
        self._rid += 1
        req = _Req(self._rid, turn, self.loop.now)
        req.p = turn.session % len(self.prefills)
        req.cursor = (turns, k)
        p = self.prefills[req.p]
        p.queue.append(req)
        self._prefill_next(p)

    def _prefill_next(self, p: _Prefill) -> None:
        if p.busy or not p.queue:
            return
        req = p.queue.popleft()
        t = req.turn
        dt = p.model.prefill_s(t.prompt - t.cached, t.cached)
        p.busy = True
        p.busy_s += dt
        self.loop.at(self.loop.now + dt, self._prefilled, p, req)

    def _prefilled(self, p: _Prefill, req: _Req) -> None:
        p.busy = False
        self._prefill_next(p)
        self._submit(req)

    # -------------------------------------------------------------- submit
    def _submit(self, req: _Req) -> None:
        """PrefillEndpoint.submit: plan the delta, route, offer to the decoders."""
        now = req.prefilled = self.loop.now
        t = req.turn
        stream = self._streams.get(t.session)
        if stream is None:
            longest = max(turn.prompt for turn in req.cursor[0])
            ids = session_tokens(t.session, longest, self.workload.system_prompt)
            all_keys = block_hashes(ids, self.block)
            stream = self._streams[t.session] = (ids, all_keys, all_keys.tolist())
        full = t.prompt // self.block
        tokens = req.tokens = stream[0][: t.prompt]
        keys = stream[1][:full]
        key_list = req.keys = stream[2][:full]  # probed per MD, as PrefillEndpoint._candidates
        req.nblocks = nblocks = -(-t.prompt // self.block)
        capacity = self.cfg.router.md_capacity
        mains = []
        # (the loop's lookups bound once: it runs for every MD of every request)
        until, senders, block_bytes, p = self._expect_until, self.senders, self.block_bytes, req.p
        for i, (name, mirror, active) in enumerate(
            zip(self.main_names, self.mirrors, self.md_active, strict=True)
        ):
            if until[i] > -math.inf:  # else it never expected a block
                mirror.expire(now)
            # a mirror that holds nothing and expects nothing predicts 0:
            # its predict is skipped
            hit = mirror.predict(key_list) if len(mirror) or now < until[i] else 0
            delta = (nblocks - hit) * block_bytes
            sender = senders.get((p, i))
            # an idle sender (no transfer running: most of them) has nothing ahead
            ahead = sender.sched.bytes_ahead(delta) if sender is not None and sender.reqs else 0
            mains.append(MainCandidate(name, delta, ahead, active, capacity))
        held = self.held[req.p]
        relays = tuple(
            RelayCandidate(name, self.relay_slots[i] - held[i])
            for i, name in enumerate(self.relay_names)
        )
        router = self.routers[req.p]
        if self.cfg.router.link_estimate == "fair-share":
            router.update_link(bandwidth_bytes_s=self._fair_share(), weight=1.0)
        decision = router.decide(
            RouteRequest(
                req.rid,
                0,
                self.cfg.workload.max_tokens,
                mains=tuple(mains),
                relays=relays,
                route=Route.P_MD if self.baseline else None,
            ),
            now,
        )
        req.md = self._index[decision.main]
        if not decision.uses_wan:
            raise SimConfigError(
                "the P->RLD-only route is not served by PrefillEndpoint", key="router"
            )
        req.decision = decision
        one_way = self.wan.one_way_s
        self.loop.at(now + one_way, self._md_offer, req, tokens, keys)
        self.md_active[req.md] += 1
        if decision.uses_rld:
            req.relay_idx = r = self._index[decision.relay]
            held[r] += 1
            self.relay_slots[r] += 1
            req.relay = RelayHandoff(req.rid, self.params, now=now)
            c = self.cfg.cluster
            landed = c.local_rtt_s + req.nblocks * self.block_bytes / c.local_bandwidth_bytes_s
            self.loop.at(now + landed, self._relay_kv_landed, req)
            self._arm(req, relay=True)

    # ------------------------------------------------------------------ MD
    def _md_offer(self, req: _Req, tokens: Any, keys: Any) -> None:
        """CachedGrants: match and pin MD's cached prefix, take blocks for the rest.

        CacheServer.handle_plan is this match and pin after decoding the
        prompt's varints; the simulation calls the RadixCache directly (the
        server still numbers the cache's changes into P's events)."""
        now = self.loop.now
        if req.end is not None and not self._keep:
            return  # over at RLD already; with keep_strange_traffic MD takes it to cache
        server, free = self.servers[req.md], self.free_blocks[req.md]
        cache = server.cache
        match = cache.match_prefix(tokens, keys=keys)
        req.match = match
        req.plan_id = cache.pin(match)
        req.hit_blocks = match.num_blocks
        need = req.nblocks - match.num_blocks
        short = need - len(free)
        if short > 0:
            free.extend(cache.evict(short))
        if len(free) < need:
            cache.unpin(req.plan_id)
            req.plan_id = None
            self._publish(req.md)
            self.loop.at(now + self.wan.one_way_s, self._refused, req)
            return
        req.owned = [free.pop() for _ in range(need)]
        self._publish(req.md)
        assert req.decision is not None
        req.main = MainHandoff(req.rid, self.params, now=now, relayed=req.decision.uses_rld)
        self._arm(req, relay=False)
        req.wan_bytes = need * self.block_bytes
        self.loop.at(now + self.wan.one_way_s, self._sender(req).start, req, req.wan_bytes)

    def _refused(self, req: _Req) -> None:
        """MD had no blocks: P's submit fails, aborting RLD's side too."""
        if req.relay is not None and not req.relay.done:
            self._leave_relay(req)
            self._release(req)
        self.md_active[req.md] -= 1
        self._end(req, "md refused: no free blocks")

    def kv_landed(self, req: _Req) -> None:
        """The WAN receiver on MD holds every byte of the delta."""
        req.landed = True
        req.landed_at = self.loop.now
        if req.main is not None and not req.main.done:
            self._feed_main(req, KvLanded())
        elif req.keep:
            self._md_free(req)

    def _sender(self, req: _Req) -> _Sender:
        key = (req.p, req.md)
        sender = self.senders.get(key)
        if sender is None:
            sender = self.senders[key] = _Sender(self, req.p, req.md)
        return sender

    def transfer_completed(self, req: _Req, started: float) -> None:
        """P's side saw the transfer acknowledged: PrefillEndpoint._watch
        counts the prompt's blocks as held on that MD's mirror until MD's
        event about them (``CacheMirror.expect``), and samples that MD's
        link over the bytes it drained."""
        now = self.loop.now
        self.mirrors[req.md].expect(req.keys, now)
        self._expect_until[req.md] = now + self.mirrors[req.md].expect_s
        if (
            req.wan_bytes < K_BANDWIDTH_SAMPLE_BYTES
            or req.decision is None
            or self.cfg.router.link_estimate != "sampled"
        ):
            return
        router, name = self.routers[req.p], self.main_names[req.md]
        elapsed = self.loop.now - started - router.link_for(name).rtt_s
        if elapsed > 0:
            sample = (req.wan_bytes + req.decision.bytes_ahead) / elapsed
            router.update_link(bandwidth_bytes_s=sample, weight=0.2, main=name)

    def _fair_share(self) -> float:
        """What one sender's streams would get on the link now (the what-if estimate)."""
        streams = self.cfg.wan.streams
        return streams * self.wan.stream_rate(self.sending + streams)

    def _release(self, req: _Req) -> None:
        """Router.release once RLD let go (the Router's contract), and the
        directory's count of the RLD's relays."""
        if req.relay_idx >= 0 and not req.released:
            req.released = True
            self.routers[req.p].release(req.rid)
            self.held[req.p][req.relay_idx] -= 1
            self.relay_slots[req.relay_idx] -= 1

    def _feed_main(self, req: _Req, ev: Event) -> None:
        machine = req.main
        assert machine is not None
        if machine.done:
            return
        self._act(req, machine.handle(ev, self.loop.now), relay=False)
        self._arm(req, relay=False)

    def recompute_done(self, req: _Req, end: int) -> None:
        self._feed_main(req, RecomputeDone(end))

    def main_last_token(self, req: _Req) -> None:
        req.md_member = False
        # the tokens between the first and the last, which the machine is not fed
        req.md_tokens += req.turn.output - 2 - req.takeover
        last = req.turn.output - 1
        self._feed_main(req, TokenGenerated(req.token(last), req.finish_at(last)))

    def transfer_failed(self, req: _Req) -> None:
        """P's transfer failed (deadline) or was cancelled: a kept one frees MD's blocks now."""
        if req.keep:
            req.keep = False
            self._md_free(req)

    def _md_free(self, req: _Req) -> None:
        """CachedGrants.free: cache the prompt's blocks if its KV landed, free the rest
        (with keep_strange_traffic, a kept transfer's blocks once it lands)."""
        if req.freed or req.main is None or (req.keep and not req.landed):
            return
        req.freed = True
        self.md_active[req.md] -= 1
        server, free = self.servers[req.md], self.free_blocks[req.md]
        cache = server.cache
        if req.landed and req.plan_id is not None and req.match is not None:
            # CacheServer.complete: insert the prompt's blocks, release the pin
            full = req.turn.prompt // self.block
            give = req.owned[: full - req.hit_blocks]
            match = req.match
            ids = [*match.block_ids.tolist(), *give]
            result = cache.insert(req.tokens, ids, keys=match.keys)
            cache.unpin(req.plan_id)
            keep = set(give) - set(result.unused_block_ids[req.hit_blocks :])
            free.extend(b for b in req.owned if b not in keep)
        else:
            if req.plan_id is not None:
                cache.unpin(req.plan_id)
            free.extend(req.owned)
        req.match = None
        req.plan_id = None
        req.owned = []
        self._publish(req.md)

    def _publish(self, md: int) -> None:
        events = self.servers[md].events()
        if events:
            self.loop.at(self.loop.now + self.wan.one_way_s, self._mirror_apply, md, events)

    def _mirror_apply(self, md: int, events: list[Message]) -> None:
        mirror = self.mirrors[md]
        for ev in events:
            mirror.apply(ev)

    # ----------------------------------------------------------------- RLD
    def _relay_kv_landed(self, req: _Req) -> None:
        """The local transfer landed: RLD seeds P's first token and decodes."""
        relay = req.relay
        if relay is None or relay.done or relay.tokens or not relay.may_decode:
            return
        self._feed_relay(req, TokenGenerated(req.token(0), req.finish_at(0)))

    def relay_token(self, req: _Req) -> None:
        assert req.relay is not None
        pos = len(req.relay.tokens)
        self._feed_relay(req, TokenGenerated(req.token(pos), req.finish_at(pos)))

    def _feed_relay(self, req: _Req, ev: Event) -> None:
        relay = req.relay
        assert relay is not None
        if relay.done:
            return
        self._act(req, relay.handle(ev, self.loop.now), relay=True)
        if relay.done:
            return
        self._arm(req, relay=True)
        if relay.may_decode and relay.tokens and not req.rld_member:
            req.rld_member = True
            self.relays[req.relay_idx].join(req, req.turn.prompt + len(relay.tokens), -1)
        elif not relay.may_decode and req.rld_member:
            self._leave_relay(req)

    def _leave_relay(self, req: _Req) -> None:
        if req.rld_member:
            req.rld_member = False
            self.relays[req.relay_idx].leave(req)

    # -------------------------------------------------------------- outputs
    def _act(self, req: _Req, outs: list[Output], *, relay: bool) -> None:
        """Act on a machine's outputs, as HandoffDriver._act does."""
        now = self.loop.now
        for o in outs:
            if isinstance(o, Emit):
                if req.first_at is None:
                    req.first_at = now + (self._sink_rld if relay else self._sink_md)
                if relay:
                    req.rld_tokens += 1
                else:
                    if req.md_tokens == 0 and req.relay is not None:
                        last = req.relay.last_emit_at
                        req.stall = None if last is None else now - last
                    req.md_tokens += 1
            elif isinstance(o, SendMessage):
                dest = self._to_main if relay else self._to_relay
                self.loop.at(now + self.wan.one_way_s, dest, req, o.message)
            elif isinstance(o, CancelTransfer):
                if self._keep and o.reason in (AbortReason.RLD_FINISHED, AbortReason.FALLBACK):
                    req.keep = True  # the transfer goes on to feed MD's cache
                else:
                    self._sender(req).cancel(req.rid)
            elif isinstance(o, FreeBlocks):
                self._md_free(req)
            elif isinstance(o, StartRecompute):
                self.mains[req.md].extend(req, o.start, len(o.tokens))
            elif isinstance(o, TakeOver):
                self._take_over(req, o.position)
            elif isinstance(o, Done):
                if o.state.name == "FINISHED":
                    self._end(req, None)  # this side emitted the last token
                if relay:
                    self._leave_relay(req)
                    self._release(req)
                else:
                    self._md_free(req)
                self._maybe_failed(req, o)

    def _take_over(self, req: _Req, position: int) -> None:
        """MD owns the request: the token at ``position`` is ready (P's first
        token on P->MD, the last recompute's on a handoff); decode the rest."""
        self.loop.at(self.loop.now, self._main_first, req, position)

    def _main_first(self, req: _Req, position: int) -> None:
        req.takeover = position
        self._feed_main(req, TokenGenerated(req.token(position), req.finish_at(position)))
        remaining = req.turn.output - 1 - position
        if remaining > 0 and req.main is not None and not req.main.done:
            req.md_member = True
            self.mains[req.md].join(req, req.turn.prompt + position + 1, remaining)

    def _to_main(self, req: _Req, message: Message) -> None:
        if req.main is not None:
            self._feed_main(req, event_for_message(message))

    def _to_relay(self, req: _Req, message: Message) -> None:
        if req.relay is not None:
            self._feed_relay(req, event_for_message(message))

    def _arm(self, req: _Req, *, relay: bool) -> None:
        """Schedule a Timer at the machine's get_timer(), as the drivers sleep until it."""
        machine = req.relay if relay else req.main
        assert machine is not None
        when = machine.get_timer()
        if when is None or machine.done:
            return
        if relay:
            if req.rld_timer == when:
                return
            req.rld_timer = when
        else:
            if req.md_timer == when:
                return
            req.md_timer = when
        self.loop.at(when, self._timer, req, relay)

    def _timer(self, req: _Req, relay: bool) -> None:
        machine = req.relay if relay else req.main
        assert machine is not None
        when = machine.get_timer()
        if machine.done or when is None or self.loop.now < when:
            return
        if relay:
            req.rld_timer = None
            self._feed_relay(req, Timer())
        else:
            req.md_timer = None
            self._feed_main(req, Timer())

    # ------------------------------------------------------------- the end
    def _maybe_failed(self, req: _Req, done: Done) -> None:
        if req.end is not None:
            return
        machines = [m for m in (req.relay, req.main) if m is not None]
        if all(m.done for m in machines):
            why = done.error or done.state.name.lower()
            self._end(req, f"{type(done.error).__name__}: {why}" if done.error else str(why))

    def _end(self, req: _Req, failure: str | None) -> None:
        if req.end is not None:
            return
        req.end = self.loop.now
        req.failure = failure
        t = req.turn
        d = req.decision
        self.results.append(
            RequestResult(
                t.session,
                t.turn,
                t.prompt,
                t.prompt - t.cached,
                t.output,
                d.route.value if d else "",
                d.reason.name if d else "",
                req.arrival,
                req.prefilled,
                req.landed_at,
                req.first_at,
                None if failure else req.end,
                req.rld_tokens,
                req.md_tokens,
                req.wan_bytes,
                req.hit_blocks,
                req.stall,
                req.relay.rounds if req.relay is not None else 0,
                failure,
            )
        )
        turns, k = req.cursor
        if k + 1 < len(turns):
            self.loop.at(self.loop.now + turns[k + 1].delay_s, self._arrive, turns, k + 1)
        else:
            self._streams.pop(t.session, None)

    def _result(self) -> RunResult:
        stats = [s.cache.statistics() for s in self.servers]
        queried = sum(s.queried_blocks for s in stats)
        mirror = sum(m.statistics().overpredicted_blocks for m in self.mirrors)
        first = min((r.arrival for r in self.results), default=0.0)
        last = max((r.finished or r.arrival for r in self.results), default=0.0)
        return RunResult(
            "baseline" if self.baseline else "pdd",
            sorted(self.results, key=lambda r: (r.arrival, r.session)),
            last - first,
            self.hardware.counts(self.baseline),
            self.hardware.cost_per_hour(self.baseline),
            {
                "prefill": sum(p.busy_s for p in self.prefills),
                "relay": sum(e.busy_s for e in self.relays),
                "main": sum(e.busy_s for e in self.mains),
            },
            sum(s.sched.bytes_acked for s in self.senders.values()),
            sum(s.sched.bytes_resent for s in self.senders.values()),
            {
                "by_route": _sum_counts(r.statistics().by_route for r in self.routers),
                "by_reason": _sum_counts(r.statistics().by_reason for r in self.routers),
            },
            self.loop.events,
            sum(s.hit_blocks for s in stats) / queried if queried else 0.0,
            mirror,
        )


def _sum_counts(counts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out
