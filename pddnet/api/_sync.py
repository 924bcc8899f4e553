"""A thread-backed, synchronous, non-blocking facade over any endpoint.

vLLM's ``KVConnectorBase_V1`` and SGLang's ``KVSender``/``KVReceiver`` poll
from synchronous scheduler loops. :class:`SyncEndpoint` runs an endpoint and
its trio loop on a thread of its own; the engine :meth:`~SyncEndpoint.submit`
calls, which never block, and collects their outcomes with
:meth:`~SyncEndpoint.poll`, optionally sleeping on :attr:`~SyncEndpoint.wakeup_fd`
in its own selector.

Theory of operation: ``submit`` appends the call to a queue and asks trio
(``TrioToken.run_sync_soon``, which only takes a lock and writes to trio's
wake-up socket) to drain it; it never waits for the loop, so a hook that holds
the loop does not hold the engine. The loop thread is the only writer of the
wake-up pipe and closes its write end itself once nothing can post any more;
:meth:`~SyncEndpoint.close` only closes the read end, so a late write never
lands in a reused descriptor. Every ticket gets exactly one completion: its
result, its error, or a :class:`~pddnet.LocalProtocolError` when the endpoint
closed before the call finished.

Calls start in the order they were submitted: each call's task waits until
the previous one has entered its method, which then runs up to its first
checkpoint before any later call starts (trio switches tasks only there), and
the calls then run concurrently. So a ``set_first_token`` or
``mark_layer_ready`` submitted after a ``submit`` of the same request finds
the request registered, as ``PrefillEndpoint.submit`` does that before its
first checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import trio

from .._errors import LocalProtocolError, TransferTimeout

__all__ = ["Completion", "SyncEndpoint"]


@dataclass(frozen=True, slots=True)
class Completion:
    """The outcome of one submitted call (``ticket``), or an endpoint event
    (``ticket`` is None, ``result`` the event)."""

    ticket: int | None
    result: Any = None
    error: BaseException | None = None


class _Job(NamedTuple):
    ticket: int
    method: str | Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class SyncEndpoint:
    """Run an async endpoint on a background thread.

    Args:
        factory: builds the endpoint (called on the endpoint's thread).
        forward_events: if the endpoint has ``next_event()``, deliver its
            events through :meth:`poll` as completions with ``ticket=None``.

    Example::

        ep = SyncEndpoint(lambda: PrefillEndpoint("p0", pool, secret=key))
        ep.start()
        t = ep.submit("submit", rid, prompt, blocks, first, 64, sink="user")
        ...  # in the scheduler loop:
        for c in ep.poll(): ...
        ep.close()
    """

    def __init__(self, factory: Callable[[], Any], *, forward_events: bool = True) -> None:
        self._factory = factory
        self._forward = forward_events
        self._done: collections.deque[Completion] = collections.deque()
        self._pending: collections.deque[_Job] = collections.deque()
        self._tickets = itertools.count(1)
        self._lock = threading.Lock()  # submit vs. the loop's shutdown
        self._accepting = False  # under _lock
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stop: trio.Event | None = None
        self._last_entered: trio.Event | None = None  # set once the latest job entered its method
        self._error: BaseException | None = None
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self.endpoint: Any = None

    @property
    def wakeup_fd(self) -> int:
        """Readable whenever :meth:`poll` has something; :meth:`poll` drains it
        (-1 after :meth:`close`)."""
        return self._rfd

    def start(self, timeout: float = 30.0) -> SyncEndpoint:
        """Start the thread and enter the endpoint; returns once it is up.

        Raises:
            TransferTimeout: if it did not come up in ``timeout`` seconds.
            PddnetError: whatever entering the endpoint raised.
        """
        self._thread = threading.Thread(target=self._run, name="pddnet-endpoint", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise TransferTimeout(f"endpoint did not start within {timeout:g}s")
        if self._error is not None:
            raise self._error
        return self

    def submit(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> int:
        """Schedule ``await endpoint.<method>(*args, **kwargs)`` (or ``await
        method(endpoint, *args, **kwargs)`` for a callable).

        Never blocks: the call is queued and the endpoint's loop runs it when
        it next gets control (a hook holding the loop delays the call, not
        ``submit``). Calls start in submission order (see the module's notes).

        Returns:
            A ticket; its :class:`Completion` shows up in :meth:`poll`, with
            a :class:`~pddnet.LocalProtocolError` if the endpoint closed first.

        Raises:
            LocalProtocolError: if the endpoint is not running.
        """
        with self._lock:
            if not self._accepting or self._token is None:
                raise LocalProtocolError("the endpoint is not running")
            ticket = next(self._tickets)
            self._pending.append(_Job(ticket, method, args, kwargs))
            token = self._token
        # Past a shutdown the final sweep has completed the job already.
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(self._drain, idempotent=True)
        return ticket

    def poll(self) -> list[Completion]:
        """Every completion since the last call, without blocking."""
        if self._rfd >= 0:
            try:
                while os.read(self._rfd, 4096):
                    pass
            except BlockingIOError:
                pass
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def call(
        self, method: str | Callable[..., Any], *args: Any, timeout: float = 30.0, **kwargs: Any
    ) -> Any:
        """Blocking convenience for setup code: submit and wait for the result.

        Raises:
            LocalProtocolError: if the endpoint is not running.
            TooSlowError: after ``timeout`` seconds (the call is cancelled).
        """
        if self._token is None or not self._accepting:
            raise LocalProtocolError("the endpoint is not running")

        async def run() -> Any:
            with trio.fail_after(timeout):
                fn = getattr(self.endpoint, method) if isinstance(method, str) else None
                return await (fn(*args, **kwargs) if fn else method(self.endpoint, *args, **kwargs))  # type: ignore[operator]

        try:
            return trio.from_thread.run(run, trio_token=self._token)
        except trio.RunFinishedError:
            raise LocalProtocolError("the endpoint stopped during the call") from None

    def close(self, timeout: float = 10.0) -> None:
        """Leave the endpoint and stop the thread, waiting up to ``timeout``
        seconds for it. Running calls are cancelled and queued ones never run;
        both complete with a :class:`~pddnet.LocalProtocolError`, which
        :meth:`poll` still returns. Calling it again is a no-op.
        """
        thread, token = self._thread, self._token
        if thread is not None and token is not None and thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._request_stop)  # does not wait for the loop
            thread.join(timeout)
        elif thread is None and self._wfd >= 0:  # never started: no writer exists
            os.close(self._wfd)
            self._wfd = -1
        if self._rfd >= 0:
            # The write end stays open (the loop thread closes it), so a write
            # after this fails with EPIPE instead of hitting a reused descriptor.
            os.close(self._rfd)
            self._rfd = -1

    def __enter__(self) -> SyncEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------- the thread
    def _post(self, completion: Completion) -> None:
        self._done.append(completion)
        # full pipe: readable already; read end closed: nobody is listening
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.write(self._wfd, b"\0")

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by start(), or lost after close()
            self._error = exc
        finally:
            with self._lock:
                self._accepting = False
            while self._pending:  # queued after the loop's last drain
                self._closed_before(self._pending.popleft().ticket)
            self._started.set()
            os.close(self._wfd)  # the only writer, and it is done
            self._wfd = -1

    def _closed_before(self, ticket: int) -> None:
        self._post(
            Completion(
                ticket,
                error=LocalProtocolError(f"the endpoint closed before call {ticket} finished"),
            )
        )

    def _request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def _drain(self) -> None:  # on the loop, from TrioToken.run_sync_soon
        if self._nursery is None:
            return  # shutting down: the final sweep completes them
        while self._pending:
            job = self._pending.popleft()
            prev, self._last_entered = self._last_entered, trio.Event()
            self._nursery.start_soon(self._job, self.endpoint, job, prev, self._last_entered)

    async def _main(self) -> None:
        self._stop = trio.Event()
        async with self._factory() as endpoint, trio.open_nursery() as nursery:
            self.endpoint = endpoint
            self._token = trio.lowlevel.current_trio_token()
            if self._forward and hasattr(endpoint, "next_event"):
                nursery.start_soon(self._forward_events, endpoint)
            self._nursery = nursery
            with self._lock:
                self._accepting = True
            self._started.set()
            await self._stop.wait()
            with self._lock:
                self._accepting = False
            self._nursery = None
            nursery.cancel_scope.cancel()

    async def _forward_events(self, endpoint: Any) -> None:
        while True:
            self._post(Completion(None, await endpoint.next_event()))

    async def _job(
        self, endpoint: Any, job: _Job, prev: trio.Event | None, entered: trio.Event
    ) -> None:
        ticket, method, args, kwargs = job
        try:
            try:
                if prev is not None:
                    await prev.wait()
            finally:
                entered.set()  # the next job may start once this one yields
            if isinstance(method, str):
                result = await getattr(endpoint, method)(*args, **kwargs)
            else:
                result = await method(endpoint, *args, **kwargs)
        except trio.Cancelled:
            self._closed_before(ticket)
            raise
        except Exception as exc:
            self._post(Completion(ticket, error=exc))
        else:
            self._post(Completion(ticket, result))
