"""The table-driven core shared by the RLD and MD machines."""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from .._errors import LocalProtocolError, PddnetError
from ._events import Done, Event, Output
from ._state import TERMINAL, Table

__all__ = ["HandoffMachine"]

log = logging.getLogger("pddnet.handoff")


class HandoffMachine(ABC):
    """Base of :class:`RelayHandoff` and :class:`MainHandoff`.

    Subclasses set ``TABLE``, ``ERROR`` and ``HANDLERS`` (event type ->
    method name). :meth:`handle` looks the event up in the table, runs the
    handler, which returns an outcome label and queues outputs, and moves to
    ``TABLE[state, type(event)][label]``. Nothing else changes the state.
    """

    TABLE: ClassVar[Table]
    ERROR: ClassVar[enum.Enum]
    HANDLERS: ClassVar[dict[type[Event], str]]

    def __init__(self, request_id: int, initial: enum.Enum, now: float) -> None:
        self.request_id = request_id
        self._state = initial
        self._out: list[Output] = []
        self._error: PddnetError | None = None
        self.started_at = now
        self.ended_at: float | None = None
        self.history: list[tuple[enum.Enum, str, enum.Enum]] = []
        self.first_emit_at: float | None = None
        self.last_emit_at: float | None = None
        self.max_gap_s = 0.0
        self.emitted = 0

    @property
    def state(self) -> enum.Enum:
        """The current state."""
        return self._state

    @property
    def error(self) -> PddnetError | None:
        """The typed error of a failed request, if any."""
        return self._error

    @property
    @abstractmethod
    def may_decode(self) -> bool:
        """Whether this side may run the next decode step (and emit)."""

    @abstractmethod
    def get_timer(self) -> float | None:
        """The next deadline at which the driver must feed ``Timer``, or None."""

    @property
    def done(self) -> bool:
        """True in a terminal state (or ERROR)."""
        return self._state in TERMINAL or self._state is self.ERROR

    def handle(self, event: Event, now: float) -> list[Output]:
        """Feed one event at time ``now``; return the outputs to act on, in order.

        Args:
            event: the input event.
            now: the current time in seconds (any monotonic clock, but one
                clock per machine).

        Returns:
            Outputs for the driver; a terminal state adds a final :class:`Done`.

        Raises:
            LocalProtocolError: if the table does not allow ``event`` in the
                current state (or the machine is in ERROR). The machine is
                then in ERROR.
            RemoteProtocolError: if the event shows the peer broke the
                protocol. The machine is then in ERROR.
        """
        old = self._state
        if old is self.ERROR:
            raise LocalProtocolError(
                f"can't handle {type(event).__name__} in ERROR",
                request_id=self.request_id,
                state=old,
            )
        edges = self.TABLE.get((old, type(event)))
        if edges is None:
            self._set_error(now)
            raise LocalProtocolError(
                f"can't handle {type(event).__name__} in {old.name}",
                request_id=self.request_id,
                state=old,
            )
        handler: Callable[[Any, float], str] = getattr(self, self.HANDLERS[type(event)])
        try:
            label = handler(event, now)
        except PddnetError as exc:
            if exc.request_id is None:
                exc.request_id = self.request_id
            if exc.state is None:
                exc.state = old
            self._set_error(now)
            raise
        self._set_state(edges[label], label, now)
        out, self._out = self._out, []
        return out

    def _set_error(self, now: float) -> None:
        self._out = []
        self._set_state(self.ERROR, "error", now)

    def _set_state(self, new: enum.Enum, label: str, now: float) -> None:
        old = self._state
        self.history.append((old, label, new))
        if new is old:
            return
        log.debug("request %s: %s -> %s (%s)", self.request_id, old.name, new.name, label)
        self._state = new
        if new in TERMINAL:
            self.ended_at = now
            self._out.append(Done(new, self._error))

    def _fail(self, error: PddnetError) -> None:
        error.request_id = self.request_id if error.request_id is None else error.request_id
        error.state = self._state if error.state is None else error.state
        self._error = error

    def _note_emit(self, now: float) -> None:
        if self.last_emit_at is None:
            self.first_emit_at = now
        else:
            self.max_gap_s = max(self.max_gap_s, now - self.last_emit_at)
        self.last_emit_at = now
        self.emitted += 1
