"""A thread-backed, synchronous, non-blocking facade over any endpoint.

vLLM's ``KVConnectorBase_V1`` and SGLang's ``KVSender``/``KVReceiver`` poll
from synchronous scheduler loops. :class:`SyncEndpoint` runs an endpoint and
its trio loop on a thread of its own; the engine :meth:`~SyncEndpoint.submit`
calls, which never block, and collects their outcomes with
:meth:`~SyncEndpoint.poll`, optionally sleeping on :attr:`~SyncEndpoint.wakeup_fd`
in its own selector.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
        self._tickets = itertools.count(1)
        self._token: trio.lowlevel.TrioToken | None = None
        self._jobs: (
            trio.MemorySendChannel[
                tuple[int, str | Callable[..., Any], tuple[Any, ...], dict[str, Any]]
            ]
            | None
        ) = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stopped = threading.Event()
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self.endpoint: Any = None

    @property
    def wakeup_fd(self) -> int:
        """Readable whenever :meth:`poll` has something; :meth:`poll` drains it."""
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
        method(endpoint, *args, **kwargs)`` for a callable); never blocks.

        Returns:
            A ticket; its :class:`Completion` shows up in :meth:`poll`.
        """
        if self._token is None or self._jobs is None or self._stopped.is_set():
            raise LocalProtocolError("the endpoint is not running")
        ticket = next(self._tickets)
        job = (ticket, method, args, kwargs)
        trio.from_thread.run_sync(self._jobs.send_nowait, job, trio_token=self._token)
        return ticket

    def poll(self) -> list[Completion]:
        """Every completion since the last call, without blocking."""
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
        """Blocking convenience for setup code: submit and wait for the result."""
        if self._token is None:
            raise LocalProtocolError("the endpoint is not running")

        async def run() -> Any:
            with trio.fail_after(timeout):
                fn = getattr(self.endpoint, method) if isinstance(method, str) else None
                return await (fn(*args, **kwargs) if fn else method(self.endpoint, *args, **kwargs))  # type: ignore[operator]

        return trio.from_thread.run(run, trio_token=self._token)

    def close(self, timeout: float = 10.0) -> None:
        """Leave the endpoint and stop the thread (running calls are cancelled)."""
        if self._token is not None and self._stop is not None and not self._stopped.is_set():
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        if self._thread is not None:
            self._thread.join(timeout)
        for fd in (self._rfd, self._wfd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> SyncEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------- the thread
    def _post(self, completion: Completion) -> None:
        self._done.append(completion)
        with contextlib.suppress(BlockingIOError):  # a full pipe is readable already
            os.write(self._wfd, b"\0")

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by start(), or lost after close()
            self._error = exc
        finally:
            self._stopped.set()
            self._started.set()

    async def _main(self) -> None:
        self._stop = trio.Event()
        send, recv = trio.open_memory_channel[Any](1 << 16)
        self._jobs = send
        async with self._factory() as endpoint, trio.open_nursery() as nursery:
            self.endpoint = endpoint
            self._token = trio.lowlevel.current_trio_token()
            if self._forward and hasattr(endpoint, "next_event"):
                nursery.start_soon(self._forward_events, endpoint)
            nursery.start_soon(self._serve_jobs, endpoint, recv, nursery)
            self._started.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    async def _forward_events(self, endpoint: Any) -> None:
        while True:
            self._post(Completion(None, await endpoint.next_event()))

    async def _serve_jobs(self, endpoint: Any, recv: Any, nursery: trio.Nursery) -> None:
        async for ticket, method, args, kwargs in recv:
            nursery.start_soon(self._job, endpoint, ticket, method, args, kwargs)

    async def _job(
        self, endpoint: Any, ticket: int, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        try:
            if isinstance(method, str):
                result = await getattr(endpoint, method)(*args, **kwargs)
            else:
                result = await method(endpoint, *args, **kwargs)
        except Exception as exc:
            self._post(Completion(ticket, error=exc))
        else:
            self._post(Completion(ticket, result))
