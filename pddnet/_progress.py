"""Progress output that suits where it goes: one place for every progress message.

On a terminal a progress message rewrites the current line in place (``\\r``),
so a run's progress takes one line. Anywhere else (a pipe, a log file, CI)
each message is a line of its own: a ``\\r`` there does not move anything,
and the messages would run together on one line.
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["StatusLine"]


class StatusLine:
    """Progress messages on ``stream``: rewritten in place on a terminal, one line each elsewhere.

    ``with StatusLine() as status: status.update("step 1"); status.line("done")``.

    Args:
        stream: where to write (default ``sys.stdout`` at construction).
        width: a terminal's message is cut and padded to this many characters
            (so a shorter message hides the longer one before it).
        tty: whether ``stream`` is a terminal (default: ``stream.isatty()``).
    """

    def __init__(
        self, stream: TextIO | None = None, *, width: int = 90, tty: bool | None = None
    ) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.width = width
        self.tty = self.stream.isatty() if tty is None else tty
        self._shown = False  # a message is on the terminal's current line, unended

    def update(self, text: str) -> None:
        """Show ``text`` as the current progress (on a terminal, in place of the last)."""
        if self.tty:
            self.stream.write(f"\r{text[: self.width]:<{self.width}}")
            self._shown = True
        else:
            self.stream.write(f"{text}\n")
        self.stream.flush()

    def line(self, text: str) -> None:
        """Print ``text`` as a line that stays (after the current progress, if any)."""
        self.end()
        self.stream.write(f"{text}\n")
        self.stream.flush()

    def end(self) -> None:
        """End the terminal's progress line, so what is printed next starts a line."""
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False

    def __enter__(self) -> StatusLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()
