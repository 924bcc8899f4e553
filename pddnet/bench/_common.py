"""Shared plumbing of the benchmarks: options, tables, JSON, PNG, progress."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from .._progress import StatusLine
from ..transport.wan import native_path

__all__ = [
    "Progress",
    "add_common_arguments",
    "percentiles",
    "print_missing",
    "print_table",
    "run_install",
    "write_report",
    "pyplot",
]

K_EMU_HOW = (
    "the emulated WAN needs Linux, root, iproute2 (Debian/Ubuntu: apt-get install iproute2)"
    " and /dev/net/tun"
)
K_PROGRESS_LINE_S = 10.0  # off a terminal, a progress line at most this often (and the last)


def add_common_arguments(parser: argparse.ArgumentParser, *, png: bool = True) -> None:
    """``--quick`` and ``--json PATH`` (every bench), ``--png PATH`` (if it plots)."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run (a minute or two; the CI-sized configuration)",
    )
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")
    if png:
        parser.add_argument("--png", metavar="PATH", help="write a plot as PNG")


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """mean, p50, p99, max, min and std of ``samples``."""
    a = np.asarray(samples, dtype=float)
    if a.size == 0:
        return {k: math.nan for k in ("mean", "p50", "p99", "max", "min", "std")}
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
        "min": float(a.min()),
        "std": float(a.std()),
    }


def run_install(cmds: Sequence[Sequence[str]], errors: dict[str, str]) -> bool:
    """Run the commands that install a missing peer (``--install-peers``), in order.

    A command that fails or cannot start leaves its stderr tail in ``errors``
    under its last argument (the package, say); the rest still run.

    Returns:
        Whether every command succeeded.
    """
    ok = True
    for cmd in cmds:
        try:
            r = subprocess.run(list(cmd), capture_output=True, text=True)
            failed, why = r.returncode != 0, r.stderr[-1000:]
        except OSError as exc:
            failed, why = True, f"{cmd[0]}: {exc}"
        if failed:
            errors[cmd[-1]] = why
            ok = False
    return ok


def print_table(rows: Sequence[dict[str, Any]], title: str = "", file: Any = None) -> None:
    """Print dict rows as an aligned text table."""
    file = file or sys.stdout
    if not rows:
        return
    cols = list(rows[0])
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    if title:
        print(title, file=file)
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)), file=file)


def print_missing(missing: dict[str, str], file: Any = None) -> None:
    """Print, below a benchmark's table, each peer that was missing and how to get it.

    ``missing`` is what the summary's ``missing_peers`` holds: ``{peer: why it
    is missing, and how to get it}``; the rows that needed it are not in the table.
    """
    for peer, why in missing.items():
        print(f"missing peer {peer}: {why}", file=file or sys.stdout)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return "-" if v is None else str(v)


def environment() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
        # the WAN transport's socket loop in this process and its children (the
        # compiled mover, or the pure-Python fallback; PDDNET_NATIVE=0 forces it)
        "wan_data_path": native_path(),
    }


def write_report(path: str | None, summary: dict[str, Any], **details: Any) -> dict[str, Any]:
    """Write ``{"summary": ..., "environment": ..., **details}`` to ``path`` (if given)."""
    report = {"summary": summary, "environment": environment(), **details}
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    return report


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


def pyplot() -> Any:
    """matplotlib.pyplot with the Agg backend (headless); needs the ``bench`` extra."""
    from .._optional import require

    mpl = require("matplotlib")
    mpl.use("Agg")
    return require("matplotlib.pyplot")


class Progress:
    """A progress bar on stderr: ``with Progress(total, "label") as bar: bar.advance()``.

    On a terminal it is one line, redrawn at each step; anywhere else each
    step is a line of its own (at most one every :data:`K_PROGRESS_LINE_S`
    seconds, and always the last), through :class:`~pddnet._progress.StatusLine`.
    """

    def __init__(self, total: int, label: str = "", *, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self._status = StatusLine(stream if stream is not None else sys.stderr, width=110)
        self._t0 = time.monotonic()
        self._last_line = -math.inf

    def __enter__(self) -> Progress:
        self._draw()
        return self

    def __exit__(self, *exc: object) -> None:
        self._status.end()

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.done + n, self.total)
        self._draw(note)

    def _draw(self, note: str = "") -> None:
        now = time.monotonic()
        if not self._status.tty:
            if self.done < self.total and now - self._last_line < K_PROGRESS_LINE_S:
                return
            self._last_line = now
        bar = "#" * int(30 * self.done / self.total)
        self._status.update(
            f"{self.label} [{bar:<30}] {self.done}/{self.total} {now - self._t0:5.1f}s {note[:40]}"
        )
