"""The embedding examples in README.md and docs/embedding.md run as written."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize(
    ("doc", "marker"),
    [("README.md", "PrefillEndpoint"), ("docs/embedding.md", "TokenSink(user)")],
)
def test_example_runs_and_streams_every_token(doc: str, marker: str) -> None:
    (code,) = [b for b in python_blocks(ROOT / doc) if marker in b and "trio.run" in b]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    if doc == "README.md":  # the last line is the stream: 64 tokens
        tokens = ast.literal_eval(out.stdout.strip().splitlines()[-1])
        assert isinstance(tokens, list) and len(tokens) == 64
    else:  # one line per token, positions 0..63 in order, then P's release
        lines = [ln for ln in out.stdout.splitlines() if " from " in ln]
        assert [int(ln.split()[0]) for ln in lines] == list(range(64))
        assert "P may reuse" in out.stdout
