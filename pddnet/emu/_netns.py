"""Network namespace plumbing: ``ip`` commands, ``setns``, cleanup of leftovers."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence

from .._errors import TransportError

__all__ = [
    "NETNS_DIR",
    "enter_netns",
    "ip",
    "kill_pids",
    "list_netns",
    "netns_delete",
    "netns_pids",
    "pid_alive",
    "remove_stale",
    "setns_path",
    "unavailable_reason",
]

NETNS_DIR = "/run/netns"
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def ip(*args: str, check: bool = True, ns: str | None = None) -> str:
    """Run ``ip [-n NS] ARGS`` and return its stdout.

    Raises:
        TransportError: the command failed and ``check`` is set.
    """
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    res = subprocess.run(argv, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise TransportError(f"{' '.join(argv)} failed: {res.stderr.strip()}", state=ns)
    return res.stdout


def ns_exec(ns: str, argv: Sequence[str], *, check: bool = True) -> str:
    """Run ``argv`` inside namespace ``ns`` and return stdout.

    Raises:
        TransportError: the command failed and ``check`` is set.
    """
    full = ["ip", "netns", "exec", ns, *argv]
    res = subprocess.run(full, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise TransportError(f"{' '.join(full)} failed: {res.stderr.strip()}", state=ns)
    return res.stdout


def setns_path(path: str) -> None:
    """Move the calling thread into the network namespace at ``path``.

    Raises:
        OSError: setns failed.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def enter_netns(name: str) -> Iterator[None]:
    """Run the body with the calling thread inside namespace ``name``.

    Sockets (and TUN fds) created in the body stay in that namespace after it.
    Only this thread moves; other threads are unaffected.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns_path(os.path.join(NETNS_DIR, name))
        try:
            yield
        finally:
            if _libc.setns(own, _CLONE_NEWNET) != 0:  # pragma: no cover - cannot recover
                err = ctypes.get_errno()
                raise OSError(err, f"setns back: {os.strerror(err)}")
    finally:
        os.close(own)


def list_netns() -> list[str]:
    """Names of the named network namespaces."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def netns_pids(name: str) -> list[int]:
    """PIDs of processes whose network namespace is ``name``."""
    res = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    return [int(x) for x in res.stdout.split() if x.isdigit()]


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False


def kill_pids(pids: Sequence[int], *, grace: float = 1.0) -> None:
    """SIGTERM each PID, wait up to ``grace`` seconds, then SIGKILL the survivors."""
    pids = [p for p in pids if p > 1 and p != os.getpid()]
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.02)
    for p in pids:
        if pid_alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def netns_delete(name: str) -> None:
    """Kill every process inside namespace ``name`` (by PID), then delete it."""
    kill_pids(netns_pids(name))
    ip("netns", "delete", name, check=False)


_STALE = re.compile(r"^(?P<prefix>[a-z]+)-(?P<pid>\d+)-[0-9a-f]+-")


def remove_stale(prefix: str) -> list[str]:
    """Delete namespaces named ``PREFIX-PID-RUN-*`` whose creating PID is gone.

    Live runs (another pytest process, say) are left alone.

    Returns:
        The names deleted.
    """
    gone = []
    for name in list_netns():
        m = _STALE.match(name)
        if m and m.group("prefix") == prefix and not pid_alive(int(m.group("pid"))):
            netns_delete(name)
            gone.append(name)
    return gone


_reason: str | bool | None = False


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here (not root, no ``ip``, ...), or ``None``.

    The probe creates and deletes one scratch namespace; the answer is cached.
    """
    global _reason
    if _reason is not False:
        return _reason  # type: ignore[return-value]
    _reason = _probe()
    return _reason


def _probe() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    name = f"pddprobe-{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if res.returncode != 0:
        return f"cannot create a network namespace: {res.stderr.strip()}"
    try:
        res = subprocess.run(
            ["ip", "-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            return f"cannot create veth: {res.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return None
