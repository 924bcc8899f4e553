"""Paired A/B of pddnet's WAN CPU per GB on the emulated link (docs/wan.md, session 10).

Each process of each arm sends ``--transfers`` x 500 MB over the emulated
30 ms / 0.1 % / 1 Gbit/s link (MTU 9000, the forwarder on a CPU of its own) to a
fresh receiver; the arms alternate. An arm is Python run in the sender and the
receiver process before they start (``--arm NAME=CODE``, e.g. ``notrail=import
pddnet.transport.wan._sender as s; s.K_TRAILER_MIN_CHUNK = 1 << 62``; the arm
``base`` runs nothing). ``--cprofile`` prints the first sender's profile with
``time.thread_time`` as the clock (the trio thread's CPU, not wall time).

    sudo .venv/bin/python bench/wan_cpu_ab.py --pairs 4 --arm base= \\
        --arm 'notrail=import pddnet.transport.wan._sender as s; s.K_TRAILER_MIN_CHUNK = 1 << 62'

Prints one line per sender process: per transfer, seconds and the sender's and
receiver's CPU seconds (user + system, and user alone) for the 500 MB.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from pddnet.emu import emulated_wan

SEND = """
import os, sys
exec(os.environ.get("PDDNET_AB_PRE", ""))
from pddnet.bench import _wan_peer as peer
from pddnet.transport.wan import _sender
sys.path.insert(0, os.environ["PDDNET_AB_DIR"])
from wan_cpu_ab import thread_cpu
SNAP0, SNAP = {}, {}
_connected, _aclose = _sender.WanSender.wait_connected, _sender.WanSender.aclose
async def _snap_connected(self):
    await _connected(self)
    SNAP0.update(thread_cpu())  # the transfers start after this
async def _snap_aclose(self):
    SNAP.update(thread_cpu())  # the mover's thread lives until trio.run ends
    await _aclose(self)
_sender.WanSender.wait_connected = _snap_connected
_sender.WanSender.aclose = _snap_aclose
prof = None
if os.environ.get("PDDNET_AB_CPROFILE"):
    import cProfile, time
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
r = peer.pdd_send(sys.argv[1], 6100, 500_000_000, 8, "bbr", repeat=int(sys.argv[2]))
if prof is not None:
    import pstats
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
for tid, (name, *now) in sorted(SNAP.items()):  # over the transfers
    user, system, vol, nonvol = (a - b for a, b in zip(now, SNAP0.get(tid, (0,) * 5)[1:]))
    print("TASK tx %s user=%.2fs sys=%.2fs vol=%d nonvol=%d" % (name, user, system, vol, nonvol))
for run in r["runs"]:
    print("RUN s=%.2f tx=%.3f rx=%.3f txuser=%.3f rxuser=%.3f" % (
        run["seconds"], run["cpu_tx"], run["cpu_rx"],
        run["cpu_tx"] - run["cpu_tx_sys"], run["cpu_rx"] - run["cpu_rx_sys"]), flush=True)
"""


RECV = """
import os, runpy, sys
exec(os.environ.get("PDDNET_AB_PRE", ""))
sys.argv = ["_wan_peer", "pdd-rx", "6100"]
runpy.run_module("pddnet.bench._wan_peer", run_name="__main__")
"""


def thread_cpu(pid: int | str = "self") -> dict[int, tuple[str, float, float, int, int]]:
    """Each thread of process ``pid``: (name, user s, system s, voluntary and
    involuntary context switches), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        d = f"/proc/{pid}/task/{tid}"
        with open(d + "/comm") as f:
            name = f.read().strip()
        with open(d + "/stat") as f:
            st = f.read().rsplit(")", 1)[1].split()
        with open(d + "/status") as f:
            cs = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        out[int(tid)] = (
            name,
            int(st[11]) / tick,
            int(st[12]) / tick,
            int(cs["voluntary_ctxt_switches"]),
            int(cs["nonvoluntary_ctxt_switches"]),
        )
    return out


def _one(code: str, transfers: int, cprofile: bool) -> str:
    env = {
        "PDDNET_AB_PRE": code,
        "PDDNET_AB_DIR": os.path.dirname(os.path.abspath(__file__)),
        **({"PDDNET_AB_CPROFILE": "1"} if cprofile else {}),
    }
    with emulated_wan("30ms", rate="1000mbit", loss=0.001, mtu=9000, isolate_cpu=True) as wan:
        for host in (wan.p, wan.md):
            host.run(["sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"], check=False)
        rx = wan.md.spawn(
            [sys.executable, "-c", RECV],
            stdout=subprocess.DEVNULL,
            env={**os.environ, **env},
        )
        time.sleep(2.0)  # the receiver is listening
        argv = [sys.executable, "-c", SEND, wan.md.addr, str(transfers)]
        tx = wan.p.spawn(argv, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
        out, _ = tx.communicate(timeout=60 + 30 * transfers)
        # the receiver's threads over its life (start-up and idle included)
        for name, user, system, vol, nonvol in sorted(thread_cpu(rx.pid).values()):
            out += f"TASK rx {name} user={user:.2f}s sys={system:.2f}s vol={vol} nonvol={nonvol}\n"
        rx.kill()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4, help="cycles over the arms")
    ap.add_argument("--transfers", type=int, default=2, help="500 MB transfers per process")
    ap.add_argument("--arm", action="append", default=[], help="NAME=CODE (repeatable)")
    ap.add_argument("--cprofile", action="store_true", help="profile the first sender")
    args = ap.parse_args()
    arms = [a.partition("=")[::2] for a in args.arm] or [("base", "")]
    first = True
    for _ in range(args.pairs):
        for name, code in arms:
            out = _one(code, args.transfers, args.cprofile and first)
            if args.cprofile and first:
                print(out)
            first = False
            runs = " ".join(line[4:] for line in out.splitlines() if line.startswith("RUN "))
            print(f"{name}: {runs}", flush=True)
            for line in out.splitlines():
                if line.startswith("TASK "):
                    print(f"  {name} {line[5:]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
