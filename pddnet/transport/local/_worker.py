"""A UCX worker progressed from trio, without a busy loop.

How it is driven (measured, see docs/local.md): the worker runs in *blocking
progress mode*. The trio task calls ``progress`` until UCX has nothing left,
completes the requests that finished, then ``arm``s the worker and sleeps in
``trio.lowlevel.wait_readable`` on the worker's epoll fd. UCX makes that fd
readable when a transport has an event. Two refinements:

* **bounded spin** (off by default): while requests someone awaits are
  outstanding, the task can keep progressing (yielding to trio between rounds)
  for up to ``spin_us`` after the last event before arming. On this 2-core
  machine, shared with other work, spinning made every size slower (16 MiB
  fell from 12.6 to 4.9 GB/s at 50 µs: the spinning process takes the CPU
  its peer needs to progress), so ``spin_us`` defaults to 0; it may pay on
  machines with cores to spare;
* **send ticks**: UCX signals the epoll fd for incoming data but not when a
  *send* completes (a shared-memory FIFO drained by the peer, a TCP socket
  writable again). While sends are outstanding the sleep is therefore capped,
  starting at 50 µs and backing off to 2 ms. Without this a batch of small
  sends waited for the fallback tick: a 720-piece KV transfer took 22 s
  instead of 0.1 s;
* **fallback tick**: even when armed, the task progresses every
  ``K_FALLBACK_S`` (ucx-py found that some transports can miss a wake-up);
* **work for the next round** (:meth:`soon`): what can wait for the task's
  next round (a layer's sends while others are in flight) runs at its start,
  before it progresses, without a wake-up of its own; a sleep is cut to
  ``K_SEND_TICK_S`` at most. Marks that come between two rounds then leave
  together (docs/local.md, *Layer by layer*).

**Low-latency mode** (opt-in, :meth:`poll`): a task waiting for a small
transfer busy-polls the worker itself for a bounded budget, running the
completions inline, so neither an epoll sleep nor a trio task switch sits on
the path; rounds without progress call ``sched_yield`` so a peer sharing the
core still runs (without it, two pollers on one core took ~770 µs per 4 KiB
round trip instead of ~70 µs). Work that is not urgent (re-posting a control
inbox) is :meth:`defer`-red until after the round's answers went out.

The alternative, ucxx's C++ progress thread with wake-ups posted into trio
through a notifier thread and ``TrioToken.run_sync_soon``, was slower on
every size measured here and needs asyncio futures, so it is not used.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from ..._errors import PeerUnavailable, TransportError
from ..._optional import require

log = logging.getLogger("pddnet.transport.local")

__all__ = ["UcxWorker", "K_DEFAULT_TLS", "detects_dead_peers"]

K_DEFAULT_TLS = "tcp,sm,self"  # used only when neither UCX_TLS nor tls= is given
# Transports with UCX peer-failure handling. Endpoints ask for error handling
# only when every transport a worker may use is one of these: asking for it
# excludes the others (sm/posix/sysv, cma, ...), which cannot detect a dead
# peer, and costs their throughput (docs/local.md, *Dead senders*).
K_PEER_FAILURE_TLS = frozenset(
    {"tcp", "self", "rc", "rc_v", "rc_x", "rc_mlx5", "dc", "dc_x", "dc_mlx5"}
    | {"ud", "ud_v", "ud_x", "ud_mlx5", "ib", "cuda_copy", "rocm_copy"}
)
# UCX options pddnet sets where neither the environment (UCX_<name>) nor
# ``config=`` does, as ucxx sets its own on import. Measured cross-host
# (dc-a-p -> dc-a-rld, UCX_TLS=tcp,self, 16 MiB, paired rounds; docs/local.md,
# *UCX settings*): with error handling on, UCX sends a tagged message of 8 KiB
# and up as RTR + active-message fragments of TCP_TX_SEG_SIZE bytes (8K by
# default); 64K fragments, with a receive segment that holds a whole one and
# its header (128K), took 16 MiB from 8.9 to 5.3-5.7 ms and both sides' CPU
# per transfer down by a third. 32K, 128K, 256K and 1M fragments, and 64K
# with a 64K receive segment, were no better than the default. Both ends use
# UcxWorker, so they agree; a peer with other values still connects.
K_UCX_DEFAULTS = {"TCP_TX_SEG_SIZE": "64k", "TCP_RX_SEG_SIZE": "128k"}
K_FALLBACK_S = 0.5  # progress at least this often even without events
# Linger: while small transfers come back to back (K_BURST_GAP_US), after an
# event progress on (yielding to trio, sched_yield when idle) for this long
# before sleeping on epoll, when nothing but inboxes is posted (transfers in
# flight sleep as before: spinning then slowed 16 MiB here). Waking a sleeping
# process costs ~30 µs in the waker's send and more in the sleeper (measured
# cross-host, docs/local.md *4 KiB one way*), twice per transfer; the next
# transfer of a burst then finds both ends awake. Costs up to this much CPU
# per transfer of a burst, and once after it.
K_LINGER_US = 200.0
# Back to back: a small transfer that finished within this long of the
# previous one (on the same worker). Isolated ones (further apart) do not
# linger: it would only cost CPU (each would find the peer asleep anyway).
K_BURST_GAP_US = 500.0
K_SEND_TICK_S = 50e-6
K_PROGRESS_BATCH = 64
K_SEND_TICK_MAX_S = 2e-3
K_ARM_RETRIES = 4  # arm() failures in a row before yielding to trio

K_SCRATCH = 64 << 10  # where discarded unexpected messages are received

Callback = Callable[[Any, BaseException | None], None]


def _ignore(req: Any, err: BaseException | None) -> None:
    pass


_CANCEL_SYMBOLS = ("_ZN4ucxx10RequestTag6cancelEv", "_ZN4ucxx7Request6cancelEv")
_cancel_fn: Any = None  # resolved once: ucxx::RequestTag::cancel (or Request::cancel)


def _request_cancel() -> Any:
    """``ucxx::Request::cancel`` of libucxx, called on a request we keep a reference to.

    ucxx's Python layer cancels a request only in ``UCXRequest.__dealloc__``, and
    then nobody can see how it ended. UCX's ``ucp_request_cancel`` completes a
    tag receive with ``UCS_ERR_CANCELED`` only while it is still *unmatched*
    (in the expected queue); a receive whose message already matched (a
    rendezvous transfer in flight) is not cancelled and goes on writing into
    its buffer until it completes. So the receiver cancels with the request
    still in hand and watches it complete (see docs/local.md, *Ending a grant*).
    Returns None if the symbol is missing: then receives are not cancelled at
    all, and a grant's end waits for them until its drain deadline closes the
    path.
    """
    global _cancel_fn
    if _cancel_fn is None:
        _cancel_fn = False
        lib_file = os.path.abspath(str(require("ucxx._lib.libucxx").__file__))
        site = os.path.dirname(os.path.dirname(os.path.dirname(lib_file)))
        for so in glob.glob(os.path.join(site, "libucxx", "lib*", "libucxx.so*")):
            try:
                lib = ctypes.CDLL(so)
            except OSError:
                continue
            for name in _CANCEL_SYMBOLS:
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.argtypes = [ctypes.c_void_p]
                    fn.restype = None
                    _cancel_fn = fn
                    break
            if _cancel_fn:
                break
        if not _cancel_fn:
            log.warning(
                "libucxx has no Request::cancel symbol: a cancelled UCX receive cannot be "
                "watched until UCX confirms it; ending a grant waits for its receives and then "
                "closes the path"
            )
    return _cancel_fn or None


def detects_dead_peers(tls: str) -> bool:
    """Whether endpoints of a worker using ``tls`` (a ``UCX_TLS`` value) ask
    UCX for error handling.

    True only when every listed transport can detect a dead peer (tcp, the
    RDMA transports, self): then a sender that dies mid-transfer makes the
    receiver's in-flight receive fail at once (measured over tcp: within
    6-11 ms of its SIGKILL, ``UCXXConnectionResetError``) instead of never
    completing. False for anything with shared memory or ``cma`` (asking for
    error handling would exclude them), for ``all`` and for ``^`` lists.
    """
    names = [x.strip() for x in tls.split(",") if x.strip()]
    return bool(names) and all(x in K_PEER_FAILURE_TLS for x in names)


class UcxWorker:
    """One UCX context and worker, progressed by a trio task (:meth:`run`).

    Args:
        tls: UCX transports (``UCX_TLS``); default: the environment's, else
            ``tcp,sm,self``.
        spin_us: how long to keep progressing after the last event while
            awaited requests are outstanding, before sleeping on epoll.
        linger_us: how long to keep progressing (yielding to trio between
            rounds) after the last event when nothing but inboxes is posted,
            before sleeping on epoll: the next message of a burst then finds
            this end awake (see :data:`K_LINGER_US`; 0: off).
        config: extra UCX options (without the ``UCX_`` prefix). Where
            neither they nor the environment set them, the options of
            :data:`K_UCX_DEFAULTS` apply (larger tcp segments, measured).
        context_of: another worker whose UCX context (and transports) this
            one shares instead of creating its own (``tls`` and ``config``
            are then ignored). A receiver gives each sender session a worker
            of its own this way (docs/local.md, *Dead senders*).

    Raises:
        MissingExtraError: if ucxx is not installed.
        TransportError: if UCX cannot create the context or worker.
    """

    def __init__(
        self,
        *,
        tls: str | None = None,
        spin_us: float = 0.0,
        linger_us: float = K_LINGER_US,
        config: dict[str, str] | None = None,
        context_of: UcxWorker | None = None,
    ) -> None:
        self._ucx = require("ucxx._lib.libucxx")
        self._arr = require("ucxx._lib.arr")
        opts = dict(config or {})
        for name, value in K_UCX_DEFAULTS.items():
            if name not in opts and "UCX_" + name not in os.environ:
                opts[name] = value
        if tls is not None:
            opts["TLS"] = tls
        elif "UCX_TLS" not in os.environ:
            opts["TLS"] = K_DEFAULT_TLS
        self.tls: str = opts.get("TLS") or os.environ.get("UCX_TLS", K_DEFAULT_TLS)
        ucx = self._ucx
        self.context: Any
        try:
            if context_of is not None:  # another worker of the same context (and transports)
                self.tls = context_of.tls
                self.context = context_of.context
            else:
                feats = (ucx.Feature.TAG, ucx.Feature.WAKEUP)
                self.context = ucx.UCXContext(opts, feature_flags=feats)
            self.worker = ucx.UCXWorker(self.context)
            self.worker.init_blocking_progress_mode()
        except Exception as exc:
            raise TransportError(f"UCX initialisation failed: {exc}") from exc
        self._fd = self.worker.epoll_file_descriptor
        self.spin_s = spin_us * 1e-6
        self.linger_s = linger_us * 1e-6
        self.active_at = 0.0  # when progress last found an event (see linger_us)
        self.bursty = False  # small transfers come back to back: linger (small_done)
        self._small_done_at = -1.0
        self.pollers = 0  # waiting tasks polling this worker themselves: run() stands by
        self._pending: dict[int, tuple[Any, Any, Callback, bool, bool]] = {}
        self._queues: dict[int, deque[int]] = {}
        self._dirty = False
        self._after: list[Callable[[], None]] = []
        self._deferred: list[Callable[[], None]] = []
        self._soon: list[Callable[[], None]] = []
        self._next = 0
        self._spinners = 0
        self._sends = 0
        self._sleep: trio.CancelScope | None = None
        self.closed = False
        self.halted = False  # see halt(): progress() is never called again
        self._scratch: bytearray | None = None
        self.progress_calls = 0
        self.inline_sends = 0
        self.epoll_waits = 0
        self.poll_rounds = 0
        self.linger_rounds = 0  # idle progress rounds while lingering (see linger_us)
        self.completions = 0
        self.polling = False  # inside poll(): latency first

    # ------------------------------------------------------------ addressing
    @property
    def address(self) -> bytes:
        """This worker's UCX address (pass it to :meth:`connect` elsewhere)."""
        return bytes(self.worker.address)

    def connect(self, address: bytes, *, error_handling: bool = False) -> Any:
        """An endpoint to the worker at ``address``.

        Args:
            address: the peer worker's UCX address.
            error_handling: ask UCX for peer-failure handling. Off by default:
                UCX's shared-memory transports cannot detect a dead peer, and
                asking for it excludes them (measured: 16 MiB at ~1 GB/s over
                tcp/lo instead of ~6-9 GB/s over sm); pddnet's deadlines
                detect a dead peer instead. On (see :func:`detects_dead_peers`)
                a dead peer fails the receives in flight from it. Both ends of
                a connection must agree (measured: a mismatch never delivers).

        Raises:
            PeerUnavailable: if UCX cannot reach it.
        """
        ucx = self._ucx
        try:
            addr = ucx.UCXAddress.create_from_buffer(address)
            return self.worker.create_endpoint_from_worker_address(addr, error_handling)
        except Exception as exc:
            raise PeerUnavailable(f"UCX cannot reach the peer: {exc}") from exc

    # --------------------------------------------------------------- requests
    def tag(self, value: int) -> Any:
        return self._ucx.UCXXTag(value)

    def array(self, buf: Any) -> Any:
        return self._arr.Array(buf)

    def send(
        self, ep: Any, buf: Any, tag: int, cb: Callback, *, spin: bool = True, queue: int = 0
    ) -> int:
        """Post a tagged send of ``buf``; ``cb(req, error)`` runs when it completes.

        Requests of one ``queue`` (0: a queue of its own) are checked for
        completion in posting order, head first (see :meth:`_reap`).

        Returns:
            A handle for :meth:`forget`, or 0 if the send completed while being
            posted (UCX's eager protocol: small messages, shared memory). Then
            ``cb`` is *not* called: the caller accounts for it at once, and the
            progress task is not woken (a wake-up per small send cost ~20 µs).
        """
        arr = self.array(buf)
        req = ep.tag_send(arr, self.tag(tag))
        if req.completed:
            try:
                req.check_error()
            except Exception:  # an error: reported through cb by _reap
                pass
            else:
                self.inline_sends += 1
                return 0
        return self._watch(req, arr, cb, spin, True, queue)

    def recv(self, buf: Any, tag: int, cb: Callback, *, spin: bool = False, queue: int = 0) -> int:
        """Post a tagged receive straight into ``buf`` (any sender on this worker)."""
        arr = self.array(buf)
        return self._watch(self.worker.tag_recv(arr, self.tag(tag)), arr, cb, spin, False, queue)

    def new_queue(self) -> int:
        """A fresh queue id for :meth:`send` / :meth:`recv`."""
        self._next += 1
        return -self._next

    def cancel(self, handles: list[int]) -> list[int]:
        """Cancel posted requests and keep watching those UCX could not cancel.

        UCX completes an *unmatched* tag receive at once with
        ``UCS_ERR_CANCELED``; those are dropped here (their callbacks never
        run). A receive whose message already matched (a rendezvous transfer in
        flight) cannot be cancelled: it goes on writing into its buffer until it
        completes. Those stay registered, and their callbacks run when they
        complete (with any status).

        Returns:
            The handles still in flight (their buffers may still be written).
        """
        fn = _request_cancel()
        left: list[int] = []
        for h in handles:
            entry = self._pending.get(h)
            if entry is None:
                continue
            req = entry[0]
            if fn is not None and not req.completed:
                fn(req.ucxx_ptr)
            if req.completed:
                self.forget(h)
            else:  # matched and in flight (or, without the symbol, not cancelled at all)
                left.append(h)
        if left:
            self._dirty = True
        return left

    def halt(self) -> None:
        """Never progress this worker again (the local path's last resort).

        Over UCX's receiver-driven transports (tcp, the shared-memory FIFOs,
        cma's GET) bytes land in a posted buffer only inside this process's
        ``progress()``, so after this nothing more lands. Requests stay
        registered (nothing is freed under UCX); :meth:`close` drops them.
        """
        self.halted = True
        self.wake()

    def oldest_unexpected(self) -> tuple[int, int] | None:
        """The tag and length of the oldest message no posted receive matched, or None.

        UCX keeps such messages (the payload of eager ones, the header of
        rendezvous ones) in its unexpected queue until a receive matches them.
        """
        r = self.worker.tag_probe(self.tag(0), self._ucx.UCXXTagMask(0), False)
        return (int(r.sender_tag.value), int(r.length)) if r.matched else None

    def discard(self, tag: int) -> bool:
        """Take the oldest unexpected message with ``tag`` out of UCX's queue, unread.

        It is received into a small scratch buffer (longer ones end truncated),
        never into granted memory.

        Returns:
            Whether there was such a message.
        """
        r = self.worker.tag_probe(self.tag(tag), self._ucx.UCXXTagMaskFull, True)
        if not r.matched:
            return False
        if self._scratch is None:
            self._scratch = bytearray(K_SCRATCH)
        arr = self.array(self._scratch)
        req = self.worker.tag_recv_with_handle(arr, r)
        if not req.completed:
            self._watch(req, arr, _ignore, False, False, 0)
        return True

    def close_endpoint(self, ep: Any) -> int:
        """Start closing ``ep``, an endpoint of this worker, without blocking.

        Call it once per endpoint, then drop the endpoint. Without it, the
        endpoint's destructor (ucxx's ``~Endpoint``) closes it in UCX's flush
        mode and progresses this worker in a loop until the flush completes,
        with no bound when no progress thread runs. Over ``tcp`` that flush
        waits for the peer: once a tcp endpoint has sent anything (a PUT ACK
        of a rendezvous over tcp PUT, without ``cma``), UCX flushes it with a
        zero-length PUT and waits for the peer's ACK (docs/local.md, *Closing
        endpoints*). With a peer that is never progressed again (another
        worker of this process whose task ended, a stopped sender) the
        destructor never returned (100 % CPU in a garbage collection), and on
        a halted worker it would progress what must not be progressed. After
        this call the destructor returns at once; the flush goes on while
        this worker is progressed (:meth:`run`), and the request is kept until
        it completes or :meth:`close`.

        Returns:
            A handle (see :meth:`forget`), or 0 if the close completed at once
            or was not started (an endpoint UCX closed already: a failed peer).
        """
        try:
            # With error handling, ucxx closed an endpoint whose peer failed
            # itself; closing it again returned a request whose ``completed``
            # crashed the process (SIGSEGV, measured).
            if not ep.alive:
                return 0
            req = ep.close()
            if req.completed:
                return 0
        except Exception as exc:  # already closed or failed: nothing to flush
            log.debug("UCX endpoint close failed: %s", exc)
            return 0
        return self._watch(req, None, _ignore, False, False, 0)

    def in_flight(self, handle: int) -> bool:
        """Whether the request ``handle`` is still registered (not completed, not forgotten)."""
        return handle in self._pending

    def sends_queued(self) -> bool:
        """Whether any spinning request (``spin=True``: a send, or a transfer's data
        receive) is still in flight."""
        return any(e[3] for e in self._pending.values())

    def forget(self, handle: int) -> None:
        """Drop a request: ucxx cancels it when the last reference goes."""
        entry = self._pending.pop(handle, None)
        if entry is not None:
            self._spinners -= entry[3]
            self._sends -= entry[4]

    def _watch(self, req: Any, arr: Any, cb: Callback, spin: bool, send: bool, queue: int) -> int:
        self._next += 1
        self._pending[self._next] = (req, arr, cb, spin, send)
        self._queues.setdefault(queue or self._next, deque()).append(self._next)
        self._dirty = True
        self._spinners += spin
        self._sends += send
        if self._sleep is not None and not self.polling:
            self._sleep.cancel()  # the loop must progress the new request
        return self._next

    def _reap(self) -> None:
        # Only queue heads are polled: a piece that completes before an earlier
        # one of its transfer is noticed with it. A transfer completes only when
        # all its pieces have, so nothing waits longer, and a receiver with
        # thousands of pre-posted pieces pays per transfer, not per piece
        # (scanning every request made 4 KiB transfers cost 1.1 ms here).
        done: list[int] = []
        pending = self._pending
        queues = self._queues
        for key, q in list(queues.items()):
            while q:
                entry = pending.get(q[0])
                if entry is None:  # forgotten
                    q.popleft()
                    continue
                if not entry[0].completed:
                    break
                done.append(q.popleft())
            if not q:
                del queues[key]
        self.completions += len(done)
        for h in done:
            entry = self._pending.pop(h, None)
            if entry is None:  # an earlier callback forgot it
                continue
            req, _arr, cb, spin, send = entry
            self._spinners -= spin
            self._sends -= send
            err: BaseException | None = None
            try:
                req.check_error()
            except Exception as exc:
                err = exc
            cb(req, err)
        if self._dirty:  # a callback posted new requests: they may be done already
            self._dirty = False
            self._reap()

    def poll(self, done: Callable[[], bool], budget_s: float) -> bool:
        """Busy-poll the worker from the calling task until ``done()`` or ``budget_s``.

        The low-latency mode (see docs/local.md): it blocks the trio thread for
        at most ``budget_s`` (plus one progress round), so a small transfer
        completes without an epoll sleep and a trio task switch on either side.
        Completions run their callbacks here exactly as in :meth:`run`.

        Returns:
            Whether ``done()`` became true within the budget.
        """
        worker = self.worker
        end = time.perf_counter() + budget_s
        self.polling = True
        try:
            return self._poll(worker, done, end)
        finally:
            self.polling = False
            # Waking the progress task costs a few µs (a cancel and an
            # epoll_ctl), so only when it has work an incoming event would not
            # start: sends in flight (UCX signals no send completion) or answers
            # not yet sent. Deferred reposts wait for the next event or poll.
            if self._sends or self._after or self._soon:
                self.wake()

    def _poll(self, worker: Any, done: Callable[[], bool], end: float) -> bool:
        while not self.halted:
            if self._soon:
                self._run_soon()
            made = False
            for _ in range(K_PROGRESS_BATCH):
                if not worker.progress_once():
                    break
                made = True
            self.poll_rounds += 1
            if made:
                self.active_at = time.perf_counter()
            self._run_deferred()
            self._dirty = False
            self._reap()
            self._run_after()
            if done():  # deferred work waits for the next poll or the progress task
                self._dirty = self._dirty or bool(self._deferred)
                return True
            if time.perf_counter() >= end:
                self._run_deferred()
                return False
            if not made:
                # Nothing yet: let a process sharing this core run (the peer,
                # when there are fewer free cores than pollers); ~1 µs otherwise.
                os.sched_yield()
        return done()

    def lingering(self) -> bool:
        """Whether this worker lingers now: small transfers come back to back
        and progress found an event within the last ``linger_us``."""
        return self.bursty and time.perf_counter() - self.active_at < self.linger_s

    def small_done(self) -> None:
        """A small transfer on this worker finished: from now on it lingers
        after events iff the previous one finished within :data:`K_BURST_GAP_US`."""
        now = time.perf_counter()
        self.bursty = now - self._small_done_at < K_BURST_GAP_US * 1e-6
        self._small_done_at = now

    def after_reap(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once after the current (or next) round of completions.

        Lets callers batch what completions produce (the receiver's DONEs).
        """
        self._after.append(fn)
        self._dirty = True
        if not self.polling:  # poll() runs it in this round itself
            self.wake()

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` after the next batch of progress: work off the latency
        path (re-posting a control inbox; a message arriving meanwhile waits in
        UCX's unexpected queue)."""
        self._deferred.append(fn)
        self._dirty = True
        if not self.polling:
            self.wake()

    def soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at the start of the progress task's next round, before it
        progresses, within :data:`K_SEND_TICK_S`.

        The task is not woken for it: a round that comes anyway (an event, a
        send tick) runs it, and a longer sleep is cut to ``K_SEND_TICK_S``.
        A poll (:meth:`poll`) runs it too, in its next round. When it posted
        requests, the task yields to trio once before progressing, so that
        what the tasks it let run queue meanwhile leaves in the same round.
        Lets callers batch what would each wake the task (a layer's sends:
        its marks come one by one, and the sends posted in one round leave
        together, their RTS ahead of the data that round pushes).
        """
        self._soon.append(fn)
        sleep = self._sleep
        if sleep is not None:
            deadline = trio.current_time() + K_SEND_TICK_S
            if deadline < sleep.deadline:
                sleep.deadline = deadline

    def _run_soon(self) -> bool:
        """Run the work for this round; whether it posted requests."""
        before = self._next
        fns, self._soon = self._soon, []
        for fn in fns:
            fn()
        return self._next != before

    def wake(self) -> None:
        """Make the progress task run a round now instead of sleeping on epoll."""
        self._dirty = True
        if self._sleep is not None:
            self._sleep.cancel()

    def _run_after(self) -> None:
        while self._after:
            fns, self._after = self._after, []
            for fn in fns:
                fn()

    def _run_deferred(self) -> None:
        if self._deferred:
            fns, self._deferred = self._deferred, []
            for fn in fns:
                fn()

    # ---------------------------------------------------------------- driving
    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Progress the worker until cancelled (start it in a nursery)."""
        task_status.started()
        worker = self.worker
        last_event = time.perf_counter()
        idle_naps = 0
        woke_by_tick = False
        busy = 0
        while not self.halted:
            if self.pollers:  # a waiting task progresses this worker (UcxService.wait_small)
                await trio.lowlevel.checkpoint()
                continue
            if self._soon and self._run_soon():
                # Sends posted for this round: let the tasks that queued them
                # run once more first (a marker's next layer), so what they
                # add leaves in this round too. Bounded: once max_inflight
                # pieces are posted, a pump posts nothing and the round goes on.
                await trio.lowlevel.checkpoint()
                continue
            made = False
            for _ in range(K_PROGRESS_BATCH):  # bounded: trio's other tasks must run
                if not worker.progress_once():
                    break
                made = True
            self.progress_calls += 1
            if made:
                last_event = self.active_at = time.perf_counter()
                idle_naps = 0
            # Deferred work runs after a progress batch: a rendezvous that the
            # last round's receives matched has started (or finished) by now.
            self._run_deferred()
            # Requests complete inside progress, or inline when posted: with
            # neither, there is nothing to reap.
            completed = self.completions
            if made or self._dirty or woke_by_tick:
                self._dirty = False
                self._reap()
                self._run_after()
            woke_by_tick = False
            if self.completions != completed:
                # Completions may have woken tasks (a wait_transfer): let them run
                # now, not after the next transfer's data (measured: a receiver
                # learned of a 16 MiB transfer 3 ms after its DONE had left).
                await trio.lowlevel.checkpoint()
            if self._dirty or self._deferred or self._soon:  # new requests, work to run
                busy += 1
                if busy % K_ARM_RETRIES == 0:
                    await trio.lowlevel.checkpoint()
                continue
            if self._spinners and time.perf_counter() - last_event < self.spin_s:
                await trio.lowlevel.checkpoint()
                continue
            if not self._spinners and self.lingering():
                if not made:
                    self.linger_rounds += 1
                    os.sched_yield()
                await trio.lowlevel.checkpoint()
                continue
            if not worker.arm():
                # UCX had events left (usually the wake-up's own): progress
                # again at once; a trio round here cost ~15 µs per transfer.
                busy += 1
                if busy % K_ARM_RETRIES == 0:
                    await trio.lowlevel.checkpoint()
                continue
            self.epoll_waits += 1
            # UCX raises no event when a *send* completes (a full shared-memory
            # FIFO drained by the peer, a TCP socket writable again), so while
            # sends are outstanding the sleep is short, backing off 50 µs -> 2 ms.
            if self._sends:
                nap = min(K_SEND_TICK_MAX_S, K_SEND_TICK_S * (1 << min(idle_naps, 6)))
                idle_naps += 1
            else:
                nap = K_FALLBACK_S
            self._sleep = trio.CancelScope(deadline=trio.current_time() + nap)
            try:
                with self._sleep:
                    await trio.lowlevel.wait_readable(self._fd)
            finally:
                woke_by_tick = self._sleep.cancelled_caught and nap == K_FALLBACK_S
                self._sleep = None
            last_event = time.perf_counter()
        await trio.sleep_forever()  # halted: never progress again (until cancelled)

    def close(self) -> None:
        """Drop every request (UCX cancels them). The context goes with the object."""
        self.closed = True
        self._deferred.clear()
        self._after.clear()
        self._soon.clear()
        self._pending.clear()
        self._queues.clear()
        self._spinners = self._sends = 0
