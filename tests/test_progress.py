"""Progress output: in place on a terminal, one line per message anywhere else."""

from __future__ import annotations

import io

import pytest

from pddnet._progress import StatusLine
from pddnet.bench import _common
from pddnet.bench._common import Progress


def test_off_a_terminal_each_message_is_a_line() -> None:
    out = io.StringIO()  # not a terminal: what a pipe, a log or CI gets
    with StatusLine(out) as status:
        status.update("session 0 turn 0: finished")
        status.update("session 1 turn 0: finished")
        status.line("phase pdd done")
    assert out.getvalue() == (
        "session 0 turn 0: finished\nsession 1 turn 0: finished\nphase pdd done\n"
    )


def test_on_a_terminal_messages_rewrite_one_line() -> None:
    out = io.StringIO()
    with StatusLine(out, width=8, tty=True) as status:
        status.update("turn 0 finished")  # cut to the width
        status.update("turn 1")  # padded: hides the longer one before it
        status.line("done")  # ends the progress line first
        status.update("turn 2")
    assert out.getvalue() == "\rturn 0 f\rturn 1  \ndone\n\rturn 2  \n"


def test_a_terminal_line_without_progress_adds_no_blank_line() -> None:
    out = io.StringIO()
    with StatusLine(out, tty=True) as status:
        status.line("ready")
    assert out.getvalue() == "ready\n"


def test_the_bar_off_a_terminal_prints_lines_at_most_every_few_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(_common.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    with Progress(5, "bench x", stream=out) as bar:
        for dt in (1.0, 1.0, _common.K_PROGRESS_LINE_S, 1.0, 1.0):
            now[0] += dt
            bar.advance(note="step")
    lines = out.getvalue().split("\n")
    assert "\r" not in out.getvalue() and lines[-1] == ""
    # the start, the first step K_PROGRESS_LINE_S after it, and the last
    assert [ln.split("]")[1].split()[0] for ln in lines[:-1]] == ["0/5", "3/5", "5/5"]
    assert all(ln.startswith("bench x [") for ln in lines[:-1])


def test_the_bar_on_a_terminal_redraws_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(out, "isatty", lambda: True)
    with Progress(2, "b", stream=out) as bar:
        bar.advance()
        bar.advance()
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "2/2" in text.split("\r")[-1]
