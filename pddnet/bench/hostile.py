"""Hostile peers against a decode endpoint's servers: every attack, survived or not.

Runs the attack suites of issue 19, each attack against a fresh server
process while an honest peer uses it: every ``pddnet/bench/_hostile_NAME.py``
module is a suite exposing ``run_attacks(quick)`` (``wan``: the WAN
receiver's attacks, :mod:`._hostile_wan`; ``control``: the control plane's).
An attack is survived when all of its checks hold: the server stays up,
honest transfers finish bit-exact, the loop's longest CPU stall stays under
100 ms, descriptors return to their baseline, and the attack's own
requirement (an honest sender connects within 1 s, grant deadlines fire on
time, ...). The summary has ``attacks``, ``survived``, ``max_loop_stall_ms``
(wall clock, at worst) and ``honest_transfers_failed``; the exit status is 1
if any attack was not survived.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from typing import Any

import trio

from ._common import add_common_arguments, print_table, write_report
from ._hostile import summarize

__all__ = ["add_arguments", "main", "suites"]


def suites() -> list[str]:
    """The attack suites found: ``NAME`` of every ``pddnet/bench/_hostile_NAME.py``."""
    import pddnet.bench as pkg

    prefix = "_hostile_"
    return sorted(
        m.name.removeprefix(prefix)
        for m in pkgutil.iter_modules(pkg.__path__)
        if m.name.startswith(prefix)
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, png=False)
    parser.add_argument(
        "--suite",
        action="append",
        choices=suites(),
        help="run only this suite (repeatable; default: all)",
    )


async def _run(names: list[str], quick: bool) -> list[Any]:
    results: list[Any] = []
    for name in names:
        mod = importlib.import_module(f"pddnet.bench._hostile_{name}")
        results += await mod.run_attacks(quick)
    return results


def main(args: argparse.Namespace) -> int:
    names = args.suite or suites()
    results = trio.run(_run, names, args.quick)
    rows = [
        {
            "attack": r.attack,
            "survived": r.survived,
            "max_loop_stall_ms": r.max_loop_stall_ms,
            "honest_failed": r.honest_failed,
        }
        for r in results
    ]
    print_table(rows, title="hostile peers (each against a fresh server)")
    summary = {**summarize(results), "suites": names}
    for name in summary["not_survived"]:
        print(f"not survived: {name}", file=sys.stderr)
    write_report(args.json, summary, attacks=[r.as_dict() for r in results])
    return 0 if not summary["not_survived"] else 1
