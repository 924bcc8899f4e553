"""What a hostile-peer attack reports, and the summary ``pddnet bench hostile`` writes.

An attack module (:mod:`._hostile_wan`, :mod:`._hostile_control`) exposes
``async def run_attacks(quick: bool) -> list[result]``. Each attack starts its
own server process, attacks it while an honest peer uses it, and returns a
result with at least ``attack`` (its name), ``survived``,
``max_loop_stall_ms`` (the server loop's longest stall), ``honest_failed``
and ``as_dict()``: :class:`AttackResult` here, or one of that shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["K_MAX_LOOP_STALL_MS", "AttackResult", "summarize"]

K_MAX_LOOP_STALL_MS = 100.0  # issue 19: the server loop's longest stall under any attack


@dataclass(slots=True)
class AttackResult:
    """The figures of one attack run; it was survived when every check held.

    Attributes:
        attack: the attack's name.
        max_loop_stall_ms: the server loop's longest stall during the attack
            (how late a 5 ms heartbeat task in the server woke, at worst).
        honest_ok: honest transfers that finished bit-exact.
        honest_failed: honest transfers that did not (error or wrong bytes).
        checks: requirement (issue 19) -> whether it held.
        figures: what else was measured (counts, times), for the report.
    """

    attack: str
    max_loop_stall_ms: float
    honest_ok: int = 0
    honest_failed: int = 0
    checks: dict[str, bool] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def survived(self) -> bool:
        return all(self.checks.values())

    def failed_checks(self) -> list[str]:
        return [k for k, ok in self.checks.items() if not ok]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "survived": self.survived}


def summarize(results: Sequence[Any]) -> dict[str, Any]:
    """``attacks``, ``survived``, ``max_loop_stall_ms``, ``honest_transfers_failed``."""
    return {
        "attacks": len(results),
        "survived": sum(bool(r.survived) for r in results),
        "max_loop_stall_ms": max((r.max_loop_stall_ms for r in results), default=0.0),
        "honest_transfers_failed": sum(r.honest_failed for r in results),
        "not_survived": [r.attack for r in results if not r.survived],
    }
