"""The demo's request stream: skewed multi-turn sessions.

Each session opens with a long, unseen prompt (a low prefix hit: the tail
PDD masks with RLD) and continues with turns that append a few tokens to it
(a high hit: over 95% of the prompt is already cached on MD). With 4 turns a
session, 75% of requests hit above 95% and 25% hit nothing, which is the
skew of the PDD source (70-80% of requests above 95%).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DemoRequest", "make_sessions"]


@dataclass(frozen=True, slots=True)
class DemoRequest:
    """One request: ``turn`` 0 of a session is its low-hit request."""

    session: int
    turn: int
    prompt: tuple[int, ...]
    max_tokens: int


def make_sessions(
    seed: int,
    sessions: int,
    turns: int,
    *,
    vocab: int,
    first_len: tuple[int, int] = (600, 1200),
    add_len: tuple[int, int] = (16, 48),
    max_tokens: int = 32,
) -> list[list[DemoRequest]]:
    """``sessions`` lists of ``turns`` requests each; turn k+1 extends turn k's prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(sessions):
        prompt = rng.integers(0, vocab, int(rng.integers(*first_len))).tolist()
        reqs = []
        for t in range(turns):
            if t:
                prompt = prompt + rng.integers(0, vocab, int(rng.integers(*add_len))).tolist()
            reqs.append(DemoRequest(s, t, tuple(prompt), max_tokens))
        out.append(reqs)
    return out
