"""The simulated workload: multi-turn agent sessions, generated or from a trace.

A session is a run of turns. Turn ``k``'s prompt is the session's token
stream up to its length: the previous prompt, the previous answer, then the
new input (a tool result, a user message). Its *prefix hit* is the share of
the prompt that the previous prompt covers, which P's prefix cache holds:
most turns append a little (hit in ``[high_hit_min, high_hit_max]``), a few
bring a large input (hit in ``[low_hit_min, low_hit_max]``), and a
session's first turn hits only the shared system prompt. Sessions arrive as
a Poisson process; a session's next turn comes ``think`` seconds after its
previous answer finished (closed loop, as an agent waits for its answer).

Token ids are synthetic and deterministic: position ``i`` of session ``s`` is
``i`` inside the shared system prompt and ``(s + 1) * 2**17 + i`` after it, so
prompts share exactly the prefixes the sessions share.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from ._config import SimConfigError, WorkloadConfig

__all__ = ["Turn", "Workload", "session_tokens"]

K_SESSION_STRIDE = 1 << 17


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session.

    Attributes:
        session: the session's index.
        turn: its index within the session.
        prompt: prompt tokens.
        cached: leading prompt tokens P's prefix cache holds (P prefills the rest).
        output: tokens the answer has (the last one ends it).
        delay_s: for turn 0, the session's arrival time; after, the think time
            between the previous answer's end and this request.
    """

    session: int
    turn: int
    prompt: int
    cached: int
    output: int
    delay_s: float

    @property
    def hit(self) -> float:
        """The prefix hit on P: cached over prompt tokens."""
        return self.cached / self.prompt


def session_tokens(session: int, length: int, system_prompt: int) -> npt.NDArray[np.uint32]:
    """The first ``length`` token ids of ``session``'s stream."""
    pos = np.arange(length, dtype=np.uint32)
    pos[system_prompt:] += np.uint32((session + 1) * K_SESSION_STRIDE)
    return pos


def _lognormal(rng: np.random.Generator, mean: float, sigma: float) -> float:
    return float(rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma))


class Workload:
    """The sessions of one run.

    Args:
        sessions: each session's turns, in order.
        system_prompt: tokens of the shared system prompt.
    """

    def __init__(self, sessions: list[list[Turn]], system_prompt: int) -> None:
        self.sessions = sessions
        self.system_prompt = system_prompt

    @property
    def requests(self) -> int:
        return sum(len(s) for s in self.sessions)

    def mean_hit(self) -> float:
        """Mean prefix hit over every turn."""
        hits = [t.hit for s in self.sessions for t in s]
        return float(np.mean(hits)) if hits else 0.0

    def share_above(self, hit: float) -> float:
        """Share of turns whose prefix hit exceeds ``hit``."""
        hits = np.array([t.hit for s in self.sessions for t in s])
        return float((hits > hit).mean()) if hits.size else 0.0

    @classmethod
    def generate(cls, cfg: WorkloadConfig, sessions: int | None = None) -> Workload:
        """Draw sessions from the generator's distributions (seeded by ``cfg.seed``)."""
        rng = np.random.default_rng(cfg.seed)
        n = cfg.sessions if sessions is None else sessions
        out: list[list[Turn]] = []
        start = 0.0
        sysp = cfg.system_prompt_tokens
        for s in range(n):
            start += float(rng.exponential(1.0 / cfg.session_rate))
            turns = int(rng.geometric(1.0 / cfg.turns_mean))
            first = sysp + max(
                16, int(_lognormal(rng, cfg.first_input_mean, cfg.first_input_sigma))
            )
            prompt = min(first, cfg.max_context - 1)
            session = [Turn(s, 0, prompt, min(sysp, prompt), cls._output(rng, cfg), start)]
            for k in range(1, turns):
                prev = session[-1]
                low = rng.random() < cfg.low_hit_fraction
                lo, hi = (
                    (cfg.low_hit_min, cfg.low_hit_max)
                    if low
                    else (cfg.high_hit_min, cfg.high_hit_max)
                )
                h = max(float(rng.uniform(lo, hi)), 1e-3)
                prompt = max(math.ceil(prev.prompt / h), prev.prompt + prev.output + 16)
                if prompt > cfg.max_context:
                    break
                think = float(rng.exponential(cfg.think_s_mean)) if cfg.think_s_mean > 0 else 0.0
                session.append(Turn(s, k, prompt, prev.prompt, cls._output(rng, cfg), think))
            out.append(session)
        return cls(out, sysp)

    @staticmethod
    def _output(rng: np.random.Generator, cfg: WorkloadConfig) -> int:
        return int(
            min(cfg.output_max, max(1, round(_lognormal(rng, cfg.output_mean, cfg.output_sigma))))
        )

    @classmethod
    def from_trace(cls, path: str | Path, cfg: WorkloadConfig) -> Workload:
        """Read a JSON-lines trace: one request per line, a session's turns in order.

        Each line holds ``session`` (any int or string), ``prompt_tokens``,
        ``output_tokens``, and ``arrival_s`` on a session's first line or
        ``think_s`` on the others. P's cache holds the session's previous
        prompt (the system prompt for a first turn).

        Raises:
            SimConfigError: for an unreadable file or a bad line (named by number).
        """
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise SimConfigError(f"can't read the trace: {exc}", key="workload.trace") from exc
        index: dict[object, int] = {}
        out: list[list[Turn]] = []
        for no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            key = f"workload.trace:{no}"
            try:
                rec = json.loads(line)
                sid = rec["session"]
                prompt, output = int(rec["prompt_tokens"]), int(rec["output_tokens"])
                first = sid not in index
                delay = float(rec["arrival_s"] if first else rec.get("think_s", 0.0))
            except (ValueError, KeyError, TypeError) as exc:
                raise SimConfigError(f"bad record: {exc!r}", key=key) from exc
            if not 0 < prompt < cfg.max_context or not 0 < output <= cfg.max_tokens or delay < 0:
                raise SimConfigError(
                    f"prompt_tokens in (0, max_context), output_tokens in (0, max_tokens], "
                    f"times >= 0 (got {prompt}, {output}, {delay})",
                    key=key,
                )
            if first:
                index[sid] = len(out)
                out.append([])
            turns = out[index[sid]]
            s = index[sid]
            cached = (
                min(cfg.system_prompt_tokens, prompt) if first else min(turns[-1].prompt, prompt)
            )
            turns.append(Turn(s, len(turns), prompt, cached, output, delay))
        if len(out) >= (1 << 15) - 1:
            raise SimConfigError("at most 32766 sessions", key="workload.trace")
        return cls(out, cfg.system_prompt_tokens)
