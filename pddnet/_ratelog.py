"""Rate-limited warnings: what a flood of strangers can make a node log.

A hostile peer can trigger a warning per connection or per frame; logging
each one would let it fill the disk and burn the loop on formatting.
:class:`LogLimiter` lets through at most one line per *reason* per interval
and folds the rest into a count carried by the next line that gets through.
Its state is one entry per reason, and reasons are a fixed set chosen by the
caller (never a peer name or an address), so strangers cannot grow it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LogLimiter"]


class LogLimiter:
    """At most one log line per reason per ``interval`` seconds.

    Args:
        logger: where the lines go.
        interval: seconds between two lines of the same reason.
        clock: a monotonic clock (seconds); a parameter so tests can drive it.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}  # reason -> when its last line went out
        self.suppressed: dict[str, int] = {}  # reason -> lines dropped since then

    def warning(self, reason: str, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` unless ``reason`` logged within the interval.

        Returns whether the line was logged. A logged line ends with how many
        lines of the same reason were suppressed since the previous one.
        """
        now = self._clock()
        last = self._last.get(reason)
        if last is not None and now - last < self.interval:
            self.suppressed[reason] = self.suppressed.get(reason, 0) + 1
            return False
        self._last[reason] = now
        dropped = self.suppressed.pop(reason, 0)
        if dropped:  # (so an earlier line went out: ``last`` is set)
            assert last is not None
            msg += " (%d more like it suppressed in the last %.1f s)"
            args = (*args, dropped, now - last)
        self.logger.warning(msg, *args)
        return True
