"""``pddnet wan up|down|exec|check``: an emulated WAN from the command line.

``up`` builds the ``pdd`` testbed (hosts ``dc-a-p``, ``dc-a-rld``, ``dc-b-md``) and
leaves it running: the namespaces stay, the forwarder (tun backend) runs in the
background, and the state goes to ``/run/pddnet/wan.json`` (``$PDDNET_WAN_STATE``
overrides) so that ``down``, ``exec`` and ``check`` find it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from typing import Any

from .._errors import LocalProtocolError, TransportError
from ._netns import list_netns, netns_delete
from ._spec import GilbertElliott, WanSpec, parse_fraction
from ._testbed import HOSTS, Testbed, remove_stale_workdirs

__all__ = ["add_arguments", "main"]

_PREFIX = "pddw"


def state_path() -> str:
    """Where ``pddnet wan up`` records the running testbed."""
    return os.environ.get("PDDNET_WAN_STATE", "/run/pddnet/wan.json")


def _link_args(p: argparse.ArgumentParser, *, defaults: bool) -> None:
    d = (lambda v: v) if defaults else (lambda v: None)
    p.add_argument("--rtt", default=d("30ms"), help="base round-trip time (default 30ms)")
    p.add_argument("--jitter", default=d("0ms"), help="per-direction delay std dev")
    p.add_argument("--loss", default=d("0"), help="per-direction random loss, e.g. 0.1%%")
    p.add_argument("--rate", default=d("1gbit"), help="per-direction rate, e.g. 1gbit (0: none)")
    p.add_argument("--mtu", type=int, default=d(1500), help="MTU of every link (default 1500)")
    p.add_argument("--queue", default=None, help="bottleneck queue bytes (default ~1 BDP)")
    p.add_argument("--reorder", default="0", help="probability a packet skips the delay")
    p.add_argument(
        "--ge",
        default=None,
        metavar="P,R[,LOSS_BAD[,LOSS_GOOD]]",
        help="Gilbert-Elliott bursty loss (probabilities, %% allowed)",
    )
    p.add_argument("--seed", type=int, default=1, help="loss/jitter seed")
    p.add_argument("--cc", default=None, help="host TCP congestion control (kernel default)")
    p.add_argument("--backend", choices=["auto", "netem", "tun"], default="auto")
    p.add_argument("--topology", choices=["pdd"], default="pdd")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``wan`` sub-commands to ``parser``."""
    sub = parser.add_subparsers(dest="wan_command", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="build the emulated WAN and leave it running")
    _link_args(up, defaults=True)
    dn = sub.add_parser("down", help="tear the emulated WAN down")
    dn.add_argument(
        "--all", action="store_true", help="also remove every other pddw-* namespace (leftovers)"
    )
    ex = sub.add_parser("exec", help="run a command on a host: pddnet wan exec HOST -- CMD")
    ex.add_argument("host", help=f"one of {', '.join(HOSTS)} (or p, rld, md)")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="the command")
    ck = sub.add_parser(
        "check",
        help="measure RTT and throughput and run the self-checks",
        description="With link options, build a temporary WAN for the check; without, "
        "check the one `pddnet wan up` built (or a default one if none is up).",
    )
    _link_args(ck, defaults=False)
    ck.add_argument("--seconds", type=float, default=3.0, help="throughput window")
    ck.add_argument("--streams", type=int, default=4, help="parallel TCP streams")
    ck.add_argument("--tool", choices=["auto", "iperf3", "builtin"], default="auto")
    ck.add_argument("--json", default=None, metavar="PATH", help="write {'summary': ...}")


def _spec(args: argparse.Namespace) -> WanSpec:
    ge = None
    if args.ge:
        parts = [parse_fraction(x) for x in args.ge.split(",")]
        if len(parts) < 2:
            raise LocalProtocolError("--ge needs at least P,R")
        ge = GilbertElliott(*parts)
    return WanSpec.symmetric(
        rtt=args.rtt or "30ms",
        jitter=args.jitter or "0ms",
        loss=args.loss or 0.0,
        rate=args.rate or "1gbit",
        mtu=args.mtu or 1500,
        queue=args.queue,
        reorder=args.reorder,
        ge=ge,
        seed=args.seed,
        congestion_control=args.cc,
    )


def _load() -> Testbed | None:
    try:
        with open(state_path()) as f:
            return Testbed.from_state(json.load(f))
    except FileNotFoundError:
        return None


def _down(everything: bool = False) -> int:
    tb = _load()
    if tb is not None:
        tb.down()
    if everything:
        for ns in list_netns():
            if ns.startswith(_PREFIX + "-"):
                netns_delete(ns)
        remove_stale_workdirs(_PREFIX, only_dead=False)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(state_path())
    print("wan: down")
    return 0


def _up(args: argparse.Namespace) -> int:
    old = _load()
    if old is not None:
        if old.forwarder_alive() and all(ns in list_netns() for ns in old.namespaces):
            raise LocalProtocolError("an emulated WAN is already up; run `pddnet wan down`")
        _down()
    tb = Testbed(_spec(args), backend=args.backend, prefix=_PREFIX, persistent=True)
    tb.up()
    os.makedirs(os.path.dirname(state_path()), exist_ok=True)
    with open(state_path(), "w") as f:
        json.dump(tb.to_state(), f, indent=1)
    print(f"wan: up ({tb.backend} backend, rtt {tb.spec.rtt * 1e3:g} ms, mtu {tb.spec.mtu})")
    for h in tb.hosts.values():
        print(f"  {h.name:9s} {h.addr:10s} netns {h.netns}")
    return 0


def _exec(args: argparse.Namespace) -> int:
    tb = _load()
    if tb is None:
        raise LocalProtocolError("no emulated WAN is up; run `pddnet wan up`")
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise LocalProtocolError("nothing to run: pddnet wan exec HOST -- CMD")
    try:
        host = tb[args.host]
    except KeyError:
        raise LocalProtocolError(f"unknown host {args.host!r}; one of {HOSTS}") from None
    sys.stdout.flush()
    os.execvp("ip", ["ip", "netns", "exec", host.netns, *cmd])
    return 127  # pragma: no cover - execvp does not return


def _check(args: argparse.Namespace) -> int:
    from ._measure import check

    link_given = any(
        getattr(args, k) is not None for k in ("rtt", "jitter", "loss", "rate", "mtu", "queue")
    )
    existing = None if link_given else _load()
    if existing is not None and not existing.forwarder_alive():
        raise TransportError("the emulated WAN's forwarder is not running; `pddnet wan down`")
    kw: dict[str, Any] = {"seconds": args.seconds, "streams": args.streams, "tool": args.tool}
    if existing is not None:
        summary = check(existing, **kw)
    else:
        with Testbed(_spec(args), backend=args.backend, prefix="pddt") as tb:
            summary = check(tb, **kw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": _finite(summary)}, f, indent=1)
    print(
        f"backend {summary['backend']}  rtt {summary['rtt_measured_ms']:.2f} ms "
        f"(configured {summary['rtt_configured_ms']:g})  rate {summary['rate_measured_mbit']:.0f} "
        f"Mbit/s (ratio {summary['rate_ratio'] or float('nan'):.3f})  valid {summary['valid']}"
    )
    for name, c in summary["self_checks"].items():
        if not c["ok"]:
            print(f"  self-check failed: {name}: {c}")
    return 0 if summary["valid"] else 2


def _finite(obj: Any) -> Any:
    """NaN/inf -> None, so the report is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def main(args: argparse.Namespace) -> int:
    """Run ``pddnet wan ACTION``.

    Returns:
        The exit status (``check`` returns 2 when a self-check failed).

    Raises:
        LocalProtocolError: misuse (already up, not up, unknown host).
        TransportError: the testbed could not be built.
    """
    action = args.wan_command
    if action == "up":
        return _up(args)
    if action == "down":
        return _down(args.all)
    if action == "exec":
        return _exec(args)
    if action == "check":
        return _check(args)
    raise LocalProtocolError(f"unknown wan action {action!r}")  # pragma: no cover
