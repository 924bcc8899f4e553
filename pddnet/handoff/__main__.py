"""Handoff tools.

Usage:
    python -m pddnet.handoff docs docs/handoff.md   # regenerate the generated blocks
    python -m pddnet.handoff sweep [--json PATH]    # one-shot vs catch-up, virtual time
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import trio
import trio.testing

from ._diagram import update_docs
from ._params import Fallback, HandoffMode, HandoffParams
from ._standin import simulate_pair


def _sweep(json_path: str | None) -> int:
    rows = []
    cases = [
        ("one-shot", HandoffParams(mode=HandoffMode.ONE_SHOT, rtt_s=0.03), 2000.0),
        ("catch-up", HandoffParams(rtt_s=0.03), 2000.0),
        ("catch-up, MD 100 tok/s", HandoffParams(rtt_s=0.03, recompute_rate=100.0), 100.0),
        ("catch-up, MD 60 tok/s (auto)", HandoffParams(rtt_s=0.03, recompute_rate=60.0), 60.0),
        (
            "catch-up, MD 60 tok/s, one-shot fallback",
            HandoffParams(rtt_s=0.03, recompute_rate=60.0, fallback=Fallback.ONE_SHOT),
            60.0,
        ),
    ]
    for name, params, rate in cases:
        for kv_after in (1.0, 2.0, 4.0, 8.0, 16.0):

            async def one(
                p: HandoffParams = params, r: float = rate, k: float = kv_after, name: str = name
            ) -> None:
                m, _ = await simulate_pair(p, kv_after_s=k, max_tokens=1000, extend_rate=r)
                rows.append(
                    {
                        "case": name,
                        "kv_after_s": k,
                        "eager_at_landing": round(k / 0.025),
                        "rounds": m.rounds,
                        "tokens_rld": m.tokens_rld,
                        "max_gap_ms": round(m.max_gap_s * 1000, 1),
                        "rld_occupancy_s": round(m.rld_occupancy_s, 2),
                        "fallback": m.fallback or "",
                    }
                )

            trio.run(one, clock=trio.testing.MockClock(autojump_threshold=0))
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    if json_path:
        Path(json_path).write_text(
            json.dumps(
                {"summary": rows, "params": dataclasses.asdict(HandoffParams())}, default=str
            )
        )
    return 0


def main(argv: list[str]) -> int:
    """Run the handoff tools; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m pddnet.handoff")
    sub = parser.add_subparsers(dest="cmd", required=True)
    docs = sub.add_parser("docs", help="regenerate the generated blocks of a docs file")
    docs.add_argument("files", nargs="+")
    sweep = sub.add_parser("sweep", help="one-shot vs catch-up in virtual time")
    sweep.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.cmd == "docs":
        for name in args.files:
            path = Path(name)
            path.write_text(update_docs(path.read_text()))
        return 0
    return _sweep(args.json)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
