"""How long a dead instance stays in the directory: the failover time.

:func:`measure_failover` starts a child process that registers a member and
keeps its lease alive, kills it with SIGKILL once a watcher has seen it join,
and times the kill to the watcher's :class:`MemberLeft`. That is what a router
waits before it stops sending to a dead MD: the lease's remaining TTL, etcd's
expiry check (it looks for expired leases every 500 ms) and the watch's
delivery. The kill comes just after the holder's lease was granted, when the
whole TTL remains: the worst phase (a keep-alive, every third of the TTL, resets
it to the whole TTL too), so a sample is the TTL plus detection. An instance
that dies at a random moment leaves between two thirds of that and all of it.

The child is :mod:`pddnet.directory._holder`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import trio

from .._errors import PeerUnavailable, TransferTimeout
from ._etcd import EtcdDirectory
from ._member import MemberJoined, MemberLeft

__all__ = ["FailoverSample", "measure_failover", "spawn_holder"]


@dataclass(frozen=True, slots=True)
class FailoverSample:
    """One measured failover.

    Attributes:
        failover_s: from the holder's SIGKILL to the watcher's MemberLeft.
        lease_ttl: the TTL etcd granted the holder's lease, seconds.
        join_s: from spawning the holder to the watcher's MemberJoined
            (process start-up included).
    """

    failover_s: float
    lease_ttl: int
    join_s: float


def spawn_holder(url: str, cluster: str, name: str, ttl: int) -> subprocess.Popen[bytes]:
    """Start a child process that registers ``name`` (``_holder.holder_info``)
    on etcd at ``url`` under a ``ttl`` lease, keeps it alive and waits to be
    killed. Its stderr is ours; it exits 3 if it cannot register."""
    cmd = [sys.executable, "-m", "pddnet.directory._holder", url, cluster, name, str(ttl)]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


async def measure_failover(
    url: str, *, cluster: str = "failover", ttl: int = 2, join_timeout: float = 60.0
) -> FailoverSample:
    """Register a member from a child process, kill it just after it joined,
    time until a watch sees it leave (see the module's docstring).

    Raises:
        TransferTimeout: if the child did not join within ``join_timeout``
            seconds, or did not leave within ``3 * ttl + 5`` seconds of its death.
        PeerUnavailable: if etcd does not answer, or the child died before joining.
    """
    name = f"holder-{os.getpid()}-{trio.current_time():.0f}"
    async with EtcdDirectory(url, cluster=cluster, ttl=ttl) as d, d.watch("main") as events:
        t_spawn = trio.current_time()
        child = spawn_holder(url, cluster, name, ttl)
        try:
            joined = False
            with trio.move_on_after(join_timeout):
                async for ev in events:
                    if isinstance(ev, MemberJoined) and ev.member.name == name:
                        joined = True
                        break
                    if child.poll() is not None:
                        raise PeerUnavailable(f"holder exited {child.returncode} before joining")
            if not joined:
                raise TransferTimeout(f"holder {name} did not join within {join_timeout:g}s")
            t_join = trio.current_time()
            lease_ttl = await d.granted_ttl("main", name)
            child.send_signal(signal.SIGKILL)
            t_kill = trio.current_time()
            with trio.move_on_after(3 * ttl + 5):
                async for ev in events:
                    if isinstance(ev, MemberLeft) and ev.name == name:
                        t_left = trio.current_time()
                        return FailoverSample(t_left - t_kill, lease_ttl, t_join - t_spawn)
            raise TransferTimeout(f"holder {name} did not leave within {3 * ttl + 5}s of SIGKILL")
        finally:
            child.kill()
            await trio.to_thread.run_sync(child.wait)
