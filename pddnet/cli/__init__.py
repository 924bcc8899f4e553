"""The ``pddnet`` command line: ``demo``, ``bench NAME``, ``wan up|down|exec|check``.

Each command lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``; modules are imported only when their command runs, so
``pddnet --help`` is fast and needs no optional extra. Benchmarks are found by
scanning :mod:`pddnet.bench`: a module ``pddnet/bench/foo.py`` is ``pddnet bench foo``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import logging
import pkgutil
import sys
from collections.abc import Sequence
from pathlib import Path

from .._errors import PddnetError

__all__ = ["main"]

# command -> (module, help)
_COMMANDS = {
    "demo": ("pddnet.demo", "run P, RLD and MD end to end on an emulated WAN"),
    "wan": ("pddnet.emu.cli", "bring an emulated WAN up or down, run in it, check it"),
    "sim": ("pddnet.sim._cli", "simulate a cluster: baseline (all P->MD) against PDD"),
}


def _benches() -> dict[str, str]:
    """Benchmark name -> first docstring line, read without importing the module."""
    import pddnet.bench as pkg

    out = {}
    for m in pkgutil.iter_modules(pkg.__path__):
        if m.name.startswith("_"):
            continue
        path = Path(pkg.__path__[0]) / f"{m.name}.py"
        doc = ast.get_docstring(ast.parse(path.read_text())) if path.exists() else None
        out[m.name] = (doc or m.name).splitlines()[0]
    return dict(sorted(out.items()))


def _build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pddnet", description="pddnet: cross-datacenter prefill/decode handoff middleware"
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == wanted:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_main=mod.main)
    bench = sub.add_parser("bench", help="run a benchmark (pddnet bench --help lists them)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    after = argv[argv.index("bench") + 1 :] if wanted == "bench" else []
    bench_wanted = next((a for a in after if not a.startswith("-")), None)
    for name, help_ in _benches().items():
        bp = bench_sub.add_parser(name, help=help_, description=help_)
        if name == bench_wanted:
            mod = importlib.import_module(f"pddnet.bench.{name}")
            mod.add_arguments(bp)
            bp.set_defaults(_main=mod.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pddnet`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        return int(args._main(args) or 0)
    except PddnetError as exc:
        print(f"pddnet: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
