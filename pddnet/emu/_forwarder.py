"""User-space WAN forwarder between two TUN devices (the netem-less backend).

Run as ``python -m pddnet.emu._forwarder CONFIG.json``. It opens TUN device
``a.tun`` inside namespace ``a.netns`` and ``b.tun`` inside ``b.netns`` (a TUN fd
belongs to the namespace in effect when ``/dev/net/tun`` is opened, so the
single thread ``setns``-es before each open, and before any thread could exist),
then shuttles IP packets between them through two
:class:`~pddnet.emu._shaper.DirectionShaper` instances.

Timing: ``select.select`` takes a microsecond timeout (epoll's is rounded to
whole milliseconds in Python), and the process timer slack is set to 1 us so
the kernel does not batch our wake-ups. Each wake-up drains up to
``K_READ_BATCH`` packets per device and releases every packet due within
``K_EARLY`` seconds, so at 1 Gbit/s and MTU 9000 (one packet per 72 us) a
wake-up usually handles several packets.

Every ``K_STATS_PERIOD`` seconds (and at exit) the forwarder writes a JSON
stats file: per-direction counters, its CPU time, and how late packets were
released relative to their due time. The testbed's self-checks read it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import select
import signal
import struct
import sys
import time
from typing import Any

from ._netns import setns_path
from ._shaper import DirectionShaper
from ._spec import LinkSpec

K_READ_BATCH = 64  # packets read per device per wake-up
K_EARLY = 20e-6  # release packets due within this many seconds
K_STATS_PERIOD = 0.25
K_LATE = 1e-3  # a packet released later than this counts as late

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_PR_SET_TIMERSLACK = 29


class _Stop(Exception):
    pass


def open_tun(name: str, netns_path: str | None) -> int:
    """Open (attach to) TUN device ``name`` inside the namespace at ``netns_path``."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        if netns_path:
            setns_path(netns_path)
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        ifr = struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI)
        fcntl.ioctl(fd, _TUNSETIFF, ifr)
        return fd
    finally:
        if netns_path:
            setns_path(f"/proc/self/fd/{own}")
        os.close(own)


class _Lateness:
    __slots__ = ("count", "late", "max", "sum")

    def __init__(self) -> None:
        self.count = 0
        self.late = 0
        self.max = 0.0
        self.sum = 0.0


def run(cfg: dict[str, Any]) -> None:
    """Forward until SIGTERM/SIGINT. ``cfg`` is the JSON config (see module doc)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    # Die with the parent (tests): PR_SET_PDEATHSIG would fire when the parent
    # *thread* exits, which kills us under a worker-thread caller, so poll instead.
    parent = os.getppid() if cfg.get("die_with_parent") else None
    # A late wake-up is emulator error, not link behaviour: ask for a real-time
    # priority (the loop always blocks in select, so it cannot starve the box; the
    # kernel's RT throttling is a second guard), else a better nice value.
    if cfg.get("cpus"):  # a CPU of its own (Testbed isolate_cpu); single-threaded
        os.sched_setaffinity(0, cfg["cpus"])
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(int(cfg.get("rt_priority", 10))))
    except (OSError, AttributeError):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, -5)

    def _stop(signum: int, frame: object) -> None:
        raise _Stop

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)

    fa = open_tun(cfg["a"]["tun"], cfg["a"]["netns"])
    fb = open_tun(cfg["b"]["tun"], cfg["b"]["netns"])
    rtt = float(cfg["rtt"])
    ab = DirectionShaper(LinkSpec.from_dict(cfg["a_to_b"]), rtt=rtt)
    ba = DirectionShaper(LinkSpec.from_dict(cfg["b_to_a"]), rtt=rtt)
    bufsize = int(cfg["mtu"]) + 256
    stats_path = cfg.get("stats_path")
    late_ab, late_ba = _Lateness(), _Lateness()
    # busy_max: longest stretch between two selects; oversleep_max: latest timer wake-up.
    counters: dict[str, float] = {
        "write_errors": 0,
        "wakeups": 0,
        "busy_max_ms": 0.0,
        "oversleep_max_ms": 0.0,
    }
    t0 = time.monotonic()
    cpu0 = time.process_time()

    def dump(final: bool = False) -> None:
        if not stats_path:
            return
        now = time.monotonic()
        doc = {
            "pid": os.getpid(),
            "wall": now - t0,
            "cpu": time.process_time() - cpu0,
            "cpu_user": os.times().user,
            "cpu_system": os.times().system,
            "final": final,
            "queue_limit": [ab.queue_limit, ba.queue_limit],
            **counters,
            "a_to_b": {**ab.stats.snapshot(), **_late_dict(late_ab)},
            "b_to_a": {**ba.stats.snapshot(), **_late_dict(late_ba)},
        }
        tmp = stats_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, stats_path)

    read = os.read
    write = os.write
    monotonic = time.monotonic
    sel = select.select
    rlist = [fa, fb]
    next_stats = t0
    # Ready before the loop starts: the testbed waits for the first stats file.
    try:
        dump()
        while True:
            now = monotonic()
            for shaper, fd, late in ((ab, fb, late_ab), (ba, fa, late_ba)):
                nd = shaper.next_due()
                if nd is not None and nd <= now + K_EARLY:
                    for due, pkt in shaper.pop_due(now + K_EARLY):
                        try:
                            write(fd, pkt)
                        except OSError:
                            counters["write_errors"] += 1
                        d = now - due
                        late.count += 1
                        if d > 0.0:
                            late.sum += d
                            if d > late.max:
                                late.max = d
                            if d > K_LATE:
                                late.late += 1
            if now >= next_stats:
                dump()
                next_stats = now + K_STATS_PERIOD
                if parent is not None and os.getppid() != parent:
                    break
            n1 = ab.next_due()
            n2 = ba.next_due()
            wake = next_stats
            if n1 is not None and n1 < wake:
                wake = n1
            if n2 is not None and n2 < wake:
                wake = n2
            t_sel = monotonic()
            busy = t_sel - now
            if busy > counters["busy_max_ms"] * 1e-3:
                counters["busy_max_ms"] = busy * 1e3
            timeout = wake - K_EARLY - t_sel
            ready = sel(rlist, [], [], timeout if timeout > 0.0 else 0.0)[0]
            counters["wakeups"] += 1
            now = monotonic()
            if not ready:
                over = now - (wake - K_EARLY)
                if over > counters["oversleep_max_ms"] * 1e-3:
                    counters["oversleep_max_ms"] = over * 1e3
                continue
            for fd in ready:
                shaper = ab if fd == fa else ba
                push = shaper.push
                for _ in range(K_READ_BATCH):
                    try:
                        pkt = read(fd, bufsize)
                    except BlockingIOError:
                        break
                    push(pkt, now)
    except _Stop:
        pass
    finally:
        dump(final=True)
        os.close(fa)
        os.close(fb)


def _late_dict(late: _Lateness) -> dict[str, float]:
    return {
        "released": late.count,
        "late": late.late,
        "late_max_ms": late.max * 1e3,
        "late_mean_ms": (late.sum / late.count * 1e3) if late.count else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m pddnet.emu._forwarder CONFIG.json``."""
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        cfg = json.load(f)
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
