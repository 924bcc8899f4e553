"""Does UCX work between two hosts? One real transfer, before a local path is chosen.

:func:`probe_local_path` starts a :class:`UcxReceiver` (as RLD makes it:
authenticated, without ``cma``) on one host and a :class:`UcxSender` on the
other, each a fresh process (``python -m pddnet.transport.local._probe_child``),
and moves ``nbytes`` through UCX. It returns what UCX chose (the sender's
endpoint's transports) or, when anything failed, the failure in the child's
own words (the exception, and UCX's ``ERROR`` lines): the demo prints that
and takes TCP instead.

The hosts are two callables with :class:`subprocess.Popen`'s signature, such
as the testbed's :meth:`pddnet.emu.Host.spawn` (a network namespace each) or
``subprocess.Popen`` itself (this host).
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["LocalPathProbe", "probe_local_path"]

K_PROBE_BYTES = 1 << 20
K_PROBE_TIMEOUT_S = 30.0
K_MARK = "@@"  # our lines on stdout (UCX may print there too)
K_SECRET_ENV = "PDDNET_PROBE_SECRET"
K_UCX_ERROR = "UCX  ERROR"

Spawn = Callable[..., "subprocess.Popen[str]"]


@dataclass(frozen=True, slots=True)
class LocalPathProbe:
    """What :func:`probe_local_path` found.

    Attributes:
        path: ``"ucx"`` if the transfer arrived intact, else ``"tcp"``.
        transports: the sender's UCX transports (``transport/device``).
        tls: the ``UCX_TLS`` the sender used (after leaving out shared memory
            towards another network namespace).
        reason: why not UCX (None when it worked).
        seconds: the transfer's time, sender side (None when it failed).
    """

    path: str
    transports: tuple[str, ...] = ()
    tls: str = ""
    reason: str | None = None
    seconds: float | None = None


def _why(stdout: list[str], stderr: str, fallback: str) -> str:
    """The child's failure in its own words: UCX's ERROR lines (UCX logs to
    stdout) and the exception (the last line on stderr)."""
    lines = stdout + stderr.splitlines()
    ucx = [ln[ln.index(K_UCX_ERROR) :].strip() for ln in lines if K_UCX_ERROR in ln]
    ucx = list(dict.fromkeys(ucx))[:3]
    errs = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return "; ".join(ucx + errs[-1:]) or fallback


def _marked(line: str) -> dict[str, Any] | None:
    return json.loads(line[len(K_MARK) :]) if line.startswith(K_MARK) else None


class _Lines:
    """A child's stdout lines, read by a thread (a buffered pipe and select()
    do not mix: one read can take several lines, and select then waits)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self._q: queue.Queue[str | None] = queue.Queue()
        self.other: list[str] = []  # unmarked lines read so far (UCX's log)
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _read(self, f: Any) -> None:
        for line in f:
            self._q.put(line)
        self._q.put(None)

    def first_marked(self, deadline: float) -> dict[str, Any] | None:
        """The next marked line, or None once the child closed stdout or ``deadline`` passed."""
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                return None
            if (obj := _marked(line)) is not None:
                return obj
            self.other.append(line)
        return None


def _stop(proc: subprocess.Popen[str]) -> str:
    """Kill ``proc`` if it still runs; its stderr."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    return proc.stderr.read() if proc.stderr is not None else ""


def probe_local_path(
    spawn_receiver: Spawn,
    spawn_sender: Spawn,
    *,
    env: dict[str, str] | None = None,
    nbytes: int = K_PROBE_BYTES,
    timeout: float = K_PROBE_TIMEOUT_S,
) -> LocalPathProbe:
    """Move ``nbytes`` over UCX from ``spawn_sender``'s host to ``spawn_receiver``'s.

    Args:
        spawn_receiver: starts a process on RLD's host (``Popen``'s signature).
        spawn_sender: starts a process on P's host.
        env: the children's environment (default: this process's), where
            ``UCX_TLS`` and the like apply as they would to the roles.
        nbytes: the transfer's size.
        timeout: seconds for the whole probe.

    Returns:
        ``path="ucx"`` with the transports UCX chose, or ``path="tcp"`` with
        the reason (the children's exception and UCX's errors, or a timeout).
        It never raises for a failure of UCX.
    """
    env = {**(os.environ if env is None else env), K_SECRET_ENV: secrets.token_hex(32)}
    argv = [sys.executable, "-m", "pddnet.transport.local._probe_child"]
    popen: dict[str, Any] = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + timeout
    rx = spawn_receiver([*argv, "receiver", str(nbytes), str(timeout)], **popen)
    tx: subprocess.Popen[str] | None = None
    try:
        rx_out = _Lines(rx)
        grant = rx_out.first_marked(deadline)
        if grant is None:
            why = _why(rx_out.other, _stop(rx), f"the UCX receiver did not start in {timeout:g} s")
            return LocalPathProbe("tcp", reason=why)
        tx = spawn_sender([*argv, "sender", json.dumps(grant["grant"]), str(timeout)], **popen)
        tx_out = _Lines(tx)
        sent = tx_out.first_marked(deadline)
        if sent is None:
            why = _why(tx_out.other, _stop(tx), f"no UCX transfer in {timeout:g} s")
            return LocalPathProbe("tcp", reason=why)
        got = rx_out.first_marked(deadline)
        if got is None or not got.get("intact"):
            why = _why(rx_out.other, _stop(rx), "the data did not arrive intact")
            return LocalPathProbe("tcp", reason=why)
        return LocalPathProbe(
            "ucx", tuple(sent["transports"]), str(sent["tls"]), seconds=float(sent["seconds"])
        )
    finally:
        for proc in (rx, tx):
            if proc is not None:
                _stop(proc)
