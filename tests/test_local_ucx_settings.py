"""The UCX options pddnet sets itself (``K_UCX_DEFAULTS``), and how they give way.

The tcp segment sizes are a measured choice (docs/local.md, *UCX settings*):
16 MiB cross-host over UCX tcp with error handling took 8.9 ms with UCX's 8K
fragments and 5.3-5.7 ms with 64K. Each worker's context must carry them,
unless the environment or ``config=`` says otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pddnet._optional import available

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not available("ucxx._lib.libucxx"), reason="ucxx is not installed"),
]

CHILD = textwrap.dedent(
    """
    import json, os, sys
    from pddnet.transport.local._worker import UcxWorker
    w = UcxWorker(tls="tcp,self", config=json.loads(sys.argv[1]))
    shared = UcxWorker(context_of=w)  # a receiver's session worker: the same context
    c = w.context.config
    print("@@" + json.dumps({k: c.get(k) for k in ("TX_SEG_SIZE", "RX_SEG_SIZE")}
                            | {"shared": shared.context is w.context}), flush=True)
    os._exit(0)
    """
)


def _config(config: dict[str, str], **env: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", **env},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("@@")][-1]
    return dict(json.loads(line[2:]))


def test_tcp_segments_are_set_by_default() -> None:
    got = _config({})
    assert got == {"TX_SEG_SIZE": "64k", "RX_SEG_SIZE": "128k", "shared": True}, got


def test_the_environment_and_config_win() -> None:
    got = _config({"TCP_RX_SEG_SIZE": "256k"}, UCX_TCP_TX_SEG_SIZE="16k")
    # the environment's value is UCX's own (not in the options pddnet passes)
    assert got["TX_SEG_SIZE"] is None and got["RX_SEG_SIZE"] == "256k", got
