"""docs/handoff.md embeds the current rendering of the transition tables."""

from __future__ import annotations

from pathlib import Path

from pddnet.handoff import MAIN_TABLE, RELAY_TABLE, MainState, RelayState, render_mermaid
from pddnet.handoff._diagram import generated_sections, update_docs

DOC = Path(__file__).resolve().parent.parent / "docs" / "handoff.md"


def test_docs_contain_the_current_diagrams() -> None:
    text = DOC.read_text()
    for name, body in generated_sections().items():
        assert body in text, (
            f"docs/handoff.md is stale ({name}): run python -m pddnet.handoff docs docs/handoff.md"
        )
    assert update_docs(text) == text


def test_diagram_has_every_non_quiet_edge() -> None:
    """Every edge that changes state appears in the rendering, and only those."""
    for table, initial in ((RELAY_TABLE, RelayState.DECODING), (MAIN_TABLE, MainState.WAITING_KV)):
        text = render_mermaid(table, initial)
        for (src, ev), edges in table.items():
            for label, dst in edges.items():
                if dst is not src:
                    line = f"    {src.name} --> {dst.name}: {ev.__name__} ["
                    assert line in text and label in text.split(line, 1)[1].split("\n", 1)[0]
        assert "ERROR" not in text


def test_update_docs_rewrites_stale_blocks() -> None:
    stale = "\n".join(
        f"<!-- BEGIN GENERATED: {n} -->\nold\n<!-- END GENERATED: {n} -->"
        for n in generated_sections()
    )
    fresh = update_docs(stale)
    assert "old" not in fresh and "stateDiagram-v2" in fresh
