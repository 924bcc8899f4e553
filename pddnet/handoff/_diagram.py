"""Render the transition tables as text: a mermaid diagram and a markdown table.

docs/handoff.md embeds both renderings; ``tests/test_handoff_docs.py`` fails
when the docs drift from the tables.
"""

from __future__ import annotations

import enum
from collections import defaultdict

from ._state import TERMINAL, Table

__all__ = ["render_markdown", "render_mermaid"]

_QUIET = frozenset({"ignore", "wait"})


def render_mermaid(table: Table, initial: enum.Enum) -> str:
    """A mermaid ``stateDiagram-v2`` of ``table``.

    Edges are grouped per (source, event, target) with their outcome labels.
    Self-loops labelled only "ignore"/"wait" and every edge out of a terminal
    state are left out (they never change the state); the implicit edge from
    any state to ERROR on a disallowed event is not drawn.

    Args:
        table: ``RELAY_TABLE`` or ``MAIN_TABLE``.
        initial: the machine's initial state.

    Returns:
        The diagram source, one statement per line, ending with a newline.
    """
    lines = ["stateDiagram-v2", f"    [*] --> {initial.name}"]
    seen_terminal: list[str] = []
    for (src, ev), edges in table.items():
        if src in TERMINAL:
            continue
        by_dst: dict[enum.Enum, list[str]] = defaultdict(list)
        for label, dst in edges.items():
            if dst is src and label in _QUIET:
                continue
            by_dst[dst].append(label)
            if dst in TERMINAL and dst.name not in seen_terminal:
                seen_terminal.append(dst.name)
        for dst, labels in by_dst.items():
            lines.append(f"    {src.name} --> {dst.name}: {ev.__name__} [{', '.join(labels)}]")
    lines.extend(f"    {name} --> [*]" for name in seen_terminal)
    return "\n".join(lines) + "\n"


def render_markdown(table: Table) -> str:
    """The full table as markdown: state, event, outcome -> next state."""
    rows = ["| state | event | outcome -> next state |", "|---|---|---|"]
    for (src, ev), edges in table.items():
        cells = "; ".join(
            f"{label} -> {'(same)' if dst is src else dst.name}" for label, dst in edges.items()
        )
        rows.append(f"| {src.name} | {ev.__name__} | {cells} |")
    return "\n".join(rows) + "\n"


def generated_sections() -> dict[str, str]:
    """The generated blocks of docs/handoff.md, by marker name."""
    from ._state import MAIN_TABLE, RELAY_TABLE, MainState, RelayState

    return {
        "relay-diagram": "```mermaid\n"
        + render_mermaid(RELAY_TABLE, RelayState.DECODING)
        + "```\n",
        "main-diagram": "```mermaid\n" + render_mermaid(MAIN_TABLE, MainState.WAITING_KV) + "```\n",
        "relay-table": render_markdown(RELAY_TABLE),
        "main-table": render_markdown(MAIN_TABLE),
    }


def update_docs(text: str) -> str:
    """Replace every ``<!-- BEGIN GENERATED: name -->`` ... ``<!-- END GENERATED: name -->``
    block of ``text`` with the current rendering.

    Raises:
        ValueError: if a marker is missing.
    """
    for name, body in generated_sections().items():
        begin, end = f"<!-- BEGIN GENERATED: {name} -->\n", f"<!-- END GENERATED: {name} -->"
        i, j = text.find(begin), text.find(end)
        if i < 0 or j < i:
            raise ValueError(f"docs lack the generated block {name!r}")
        text = text[: i + len(begin)] + body + text[j:]
    return text
