"""``pddnet demo``: P, RLD and MD end to end across an emulated WAN.

Three OS processes (``pddnet/demo/_roles.py``) run the engine-facing API
with the reference model as the engine. As root, they live in the emulated
``pdd`` topology (P and RLD in DC-A, MD in DC-B behind a shaped WAN);
otherwise they share loopback, and the demo says so. The same stream of
skewed multi-turn requests (one seed: the same prompts, lengths and hit
structure) runs twice on the same link: routed by pddnet (P->RLD->MD for
low-hit requests), then with every request on P->MD (the baseline). Each
phase gets three fresh processes, so both start from the same state: MD's
radix cache and P's mirror of it empty, no connections open. The demo prints
a per-request timeline and a summary, writes a PNG timeline, and checks every
request's tokens against single-instance greedy decoding of the same prompt;
it exits 1 unless every request finished with the reference's tokens.
The summary's ``periodic_streams`` counts reference streams that end in a
short cycle (:func:`tail_period`), where a handoff that dropped or repeated a
cycle's worth of tokens would still match; with TINY's weights it is 0.

Scale: the tiny reference model's KV is 512 B per token, about 100x less than
a 7B-class model's, so the default WAN runs at 25 Mbit/s to keep the ratio of
KV transfer time to decode time realistic, and decode steps are paced to
20 ms (50 tokens/s) like a real model's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._progress import StatusLine
from ..bench._common import percentiles, print_table, pyplot, write_report
from ..emu import emulated_wan, parse_duration, parse_rate, unavailable_reason
from ..handoff import HandoffParams
from ..integrations.vllm import build_tiny_llama
from ..recompute import TINY, ReferenceModel, greedy
from ._local_path import choose_local_path, local_path_summary
from ._workload import DemoRequest, make_sessions
from ._zygote import RoleProcess, Zygote

__all__ = [
    "DemoRequest",
    "add_arguments",
    "main",
    "make_sessions",
    "reference_streams",
    "report",
    "run_config",
    "summarize",
    "tail_period",
    "timeline_figure",
    "vllm_reference_streams",
]

#: ``tail_period``'s defaults: cycles of up to 16 tokens (half of a 32-token
#: answer), repeating for at least 4 tokens (a run that random tokens make with
#: probability ``16 * vocab**-4``).
K_MAX_PERIOD = 16
K_MIN_RUN = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer sessions (CI)")
    parser.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default="reference",
        help="the roles' engine: the NumPy reference model (default), or three vLLM CPU"
        " instances over a tiny Llama built locally (needs the vllm extra)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the summary and records as JSON")
    parser.add_argument(
        "--png",
        metavar="PATH",
        default="out/demo-timeline.png",
        help="timeline plot (default: %(default)s)",
    )
    parser.add_argument("--sessions", type=int, default=None, help="sessions per phase")
    parser.add_argument("--turns", type=int, default=4, help="turns per session")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens per answer (default 32; 128 with --engine vllm, which decodes at its own"
        " speed, and 512 for each session's first turn there: see run_config)",
    )
    parser.add_argument("--rtt", default="30ms")
    parser.add_argument(
        "--rate",
        default=None,
        help="WAN rate (default 25mbit)",
    )
    parser.add_argument("--loss", default="0")
    parser.add_argument("--step-ms", type=float, default=20.0, help="paced decode step")
    parser.add_argument(
        "--catchup-threshold",
        type=int,
        default=None,
        help="hand over in one shot when at most this many eager tokens are pending once MD's"
        " KV lands (default: HandoffParams' 64; 16 with --engine vllm, whose extend costs"
        " one engine step whatever its size, so catch-up runs on the demo's short answers)",
    )
    parser.add_argument(
        "--playout-ms",
        type=float,
        default=40.0,
        help="RLD's playout buffer (HandoffParams.playout_s; 0: off): RLD shows its tokens up to"
        " this much later while MD may take over, spreading the switch stall over them; the"
        " summary reports what it added (playout_added_ms_*) (default %(default)s)",
    )
    parser.add_argument("--loopback", action="store_true", help="skip the emulated WAN")
    parser.add_argument(
        "--local-path",
        choices=("tcp", "ucx"),
        default="ucx",
        help="P->RLD transport (default %(default)s: a short UCX transfer between P's and RLD's"
        " hosts first; if it fails, TCP, printing why)",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rate(args: argparse.Namespace) -> str:
    return str(args.rate or "25mbit")


# vLLM decodes at its own speed. A low-hit request catches up (2+ rounds) when
# MD's KV lands D seconds after RLD's first token with 16 < rate * D < answer
# (more than --catchup-threshold eager tokens, and RLD not yet done). Measured
# at 25 Mbit/s (docs/benchmarks.md): the four first-turn prompts' KV (650-1170
# tokens, 2 KiB each, sharing the WAN) lands at D = 1.8 to 3.4 s, and RLD's
# batched rate ranged 25-180 tokens/s between runs on 2 shared cores. With
# 128-token answers RLD finished all four alone at 125 tokens/s (128 < 125 *
# 1.8). A 512-token first turn puts some request in the window at any rate
# from 16 / 3.4 = 5 to 512 / 1.8 = 280 tokens/s. Later turns (high hit,
# routed P->MD) answer --max-tokens.
K_VLLM_FIRST_TURN_TOKENS = 512

# Each vLLM process (three roles, then the oracle) runs one torch thread unless
# OMP_NUM_THREADS says otherwise: vLLM CPU keeps torch's one thread per core,
# and four engines' spinning OpenMP threads on a small machine slow every
# step (measured on 2 loaded cores: phases of 26 and 45 s with two threads,
# 7 and 8 s with one; docs/benchmarks.md). The roles and the oracle run the
# same numerics either way.
K_VLLM_THREADS = "1"


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The demo's configuration for its parsed arguments (:func:`add_arguments`):
    link, step time, workload and seed, limits; what the roles and
    ``pddnet sim --validate-demo`` are given."""
    return {
        "blocks": 8192,
        "step_time_s": args.step_ms / 1000,
        "rtt_s": parse_duration(args.rtt),
        "rate_bps": parse_rate(_rate(args)),
        "ttft_target_s": 0.15,
        "sessions": args.sessions or (4 if args.quick else 8),
        "turns": args.turns,
        "max_tokens": args.max_tokens or (128 if args.engine == "vllm" else 32),
        # vLLM: each session's first (low-hit) turn; --max-tokens sets every turn
        "first_turn_tokens": args.max_tokens or K_VLLM_FIRST_TURN_TOKENS,
        "seed": 7,
        "request_timeout_s": 60.0,
        "local_path": args.local_path,
        "engine": args.engine,
        "catchup_threshold": args.catchup_threshold
        or (16 if args.engine == "vllm" else HandoffParams().catchup_threshold),
        # vLLM: its start-up (tens of seconds on 2 cores) comes before the rendezvous
        "join_timeout_s": 300.0 if args.engine == "vllm" else 30.0,
        "phase_timeout_s": 600.0,
        "staging_blocks": 1024,
        "playout_s": args.playout_ms / 1000,
    }


_ROLES = ("prefill", "relay", "main")
_PHASES = ("pdd", "baseline")


def _spawn_roles(
    cfg: dict[str, Any],
    addrs: dict[str, str],
    ports: dict[str, int],
    spawners: dict[str, Callable[..., RoleProcess]],
) -> list[RoleProcess]:
    """Start the three role processes (P first: it hosts the rendezvous)."""
    env = {**os.environ, "PDDNET_SECRET": secrets.token_hex(32)}
    if cfg["engine"] == "vllm":
        env.setdefault("OMP_NUM_THREADS", K_VLLM_THREADS)
    procs = []
    for role in _ROLES:
        rcfg = {
            **cfg,
            "control": f"tcp://{addrs[role]}:{ports[role]}",
            "data_host": addrs[role],
            "rendezvous": f"tcp://{addrs['prefill']}:{ports['prefill']}",
        }
        module = "pddnet.demo._vllm_roles" if cfg["engine"] == "vllm" else "pddnet.demo._roles"
        argv = [sys.executable, "-m", module, role, json.dumps(rcfg)]
        procs.append(
            spawners[role](
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return procs


def _run(
    args: argparse.Namespace,
    cfg: dict[str, Any],
    tmp: Path,
    log: list[str],
    zygote: Zygote | None = None,
) -> tuple[str, dict[str, Any]]:
    """Run each phase with three fresh role processes on one link.

    With ``zygote`` (``--engine vllm``) each role's process is forked from it,
    in its host's namespace, instead of started from scratch.

    Returns:
        The link's description, and each phase's ``{"requests", "stats"}``.
    """
    reason = "--loopback was given" if args.loopback else unavailable_reason()
    out: dict[str, Any] = {}

    def phase(
        name: str,
        addrs: dict[str, str],
        ports: dict[str, int],
        spawners: dict[str, Callable[..., RoleProcess]],
    ) -> None:
        path = tmp / f"{name}.json"
        procs = _spawn_roles({**cfg, "phase": name, "out": str(path)}, addrs, ports, spawners)
        try:
            _follow(procs, log)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        out[name] = json.loads(path.read_text())

    if reason is None:
        with emulated_wan(args.rtt, rate=_rate(args), loss=args.loss, mtu=1500) as wan:
            hosts = {"prefill": wan.p, "relay": wan.rld, "main": wan.md}
            out["local_path"] = choose_local_path(
                cfg, wan.rld.spawn, wan.p.spawn, "dc-a-p -> dc-a-rld"
            )
            addrs = {r: h.addr for r, h in hosts.items()}
            for i, name in enumerate(_PHASES):
                # each role runs in its host's namespace; new ports for each phase
                ports = {r: 5550 + 3 * i + j for j, r in enumerate(_ROLES)}
                spawn: dict[str, Callable[..., RoleProcess]] = {
                    r: zygote.spawner(h.netns) if zygote else h.spawn for r, h in hosts.items()
                }
                phase(name, addrs, ports, spawn)
        return (
            f"emulated WAN ({wan.backend}): rtt {args.rtt}, rate {_rate(args)}, loss {args.loss}",
            out,
        )
    print(
        f"pddnet demo: no emulated WAN here ({reason}); running on loopback, where the WAN"
        " is not shaped and RLD has nothing to mask."
    )
    out["local_path"] = choose_local_path(cfg, subprocess.Popen, subprocess.Popen, "loopback")
    for name in _PHASES:
        phase(
            name,
            dict.fromkeys(_ROLES, "127.0.0.1"),
            {r: _free_port() for r in _ROLES},
            dict.fromkeys(_ROLES, zygote.spawner() if zygote else subprocess.Popen),
        )
    return "loopback (no WAN emulation)", out


def _follow(procs: Sequence[RoleProcess], log: list[str], timeout: float = 600) -> None:
    """Relay P's progress lines until P exits; the decoders are then stopped."""
    p = procs[0]
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    with StatusLine() as status:
        for line in p.stdout:
            line = line.rstrip()
            log.append(line)
            if "turn" in line:  # a request's progress: in place on a terminal
                status.update(f"  {line}")
            else:
                status.line(f"  {line}")
            if time.monotonic() > deadline:
                break
    p.wait(timeout=30)
    for proc in procs[1:]:
        proc.kill()
        out = proc.communicate(timeout=30)[0] or ""
        log.extend(out.splitlines())
    if p.returncode != 0:
        tail = "\n".join(log[-30:])
        raise RuntimeError(f"the P process failed (exit {p.returncode}):\n{tail}")


def reference_streams(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Single-instance greedy decoding of every request's prompt (one model,
    one sequence per session, truncated back to the prompt between turns)."""
    model = ReferenceModel.create(TINY, num_blocks=8192)
    out: dict[int, list[int]] = {}
    by_session: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rec in records:
        by_session.setdefault((rec["phase"], rec["session"]), []).append(rec)
    for recs in by_session.values():
        seq = model.new_sequence()
        done = 0
        for rec in sorted(recs, key=lambda r: r["turn"]):
            prompt = rec["prompt"]
            model.reserve(seq, len(prompt) + rec["max_tokens"])
            seq.length = done  # drop the previous answer; keep the prompt's KV
            tok = greedy(model.extend(seq, prompt[done:]))
            done = len(prompt)
            stream = [tok]
            while len(stream) < rec["max_tokens"]:
                tok = greedy(model.decode_step(seq, tok))
                stream.append(tok)
            out[rec["request_id"]] = stream
        model.release(seq)
    return out


def vllm_reference_streams(
    records: list[dict[str, Any]],
    model: str,
    tmp: Path,
    spawn: Callable[..., RoleProcess] = subprocess.Popen,
) -> dict[int, list[int]]:
    """Single-instance vLLM greedy decoding of every request's prompt on ``model``.

    One vLLM instance without pddnet, in a process of its own
    (``pddnet.demo._vllm_roles oracle``, started by ``spawn``: the demo forks
    it from its zygote), decodes each distinct prompt to the longest answer a
    record of it asks for; each record's reference is that stream's first
    ``max_tokens`` (greedy: a shorter answer is a prefix).

    Raises:
        RuntimeError: if that process failed (its output attached).
    """
    lengths: dict[tuple[int, ...], int] = {}
    for rec in records:
        key = tuple(rec["prompt"])
        lengths[key] = max(lengths.get(key, 0), rec["max_tokens"])
    prompts = sorted(lengths)
    out = tmp / "oracle.json"
    cfg = {
        "model": model,
        "prompts": prompts,
        "max_tokens": [lengths[p] for p in prompts],
        "out": str(out),
    }
    argv = [sys.executable, "-m", "pddnet.demo._vllm_roles", "oracle", json.dumps(cfg)]
    env = {"OMP_NUM_THREADS": K_VLLM_THREADS, **os.environ}  # as the roles (_spawn_roles)
    proc = spawn(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output = proc.communicate(timeout=600)[0] or ""
    finally:
        proc.kill()
        proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the vLLM oracle failed (exit {proc.returncode}):\n{output[-3000:]}")
    streams = dict(zip(prompts, json.loads(out.read_text()), strict=True))
    return {
        rec["request_id"]: streams[tuple(rec["prompt"])][: rec["max_tokens"]] for rec in records
    }


def tail_period(
    stream: Sequence[int], max_period: int = K_MAX_PERIOD, min_run: int = K_MIN_RUN
) -> int | None:
    """The shortest cycle ``stream`` ends in, or None.

    That is the smallest ``p <= max_period`` such that each of the last
    ``min_run`` tokens equals the token ``p`` before it. A stream that ends in
    a cycle still matches its reference if a handoff inside the cycle drops or
    repeats ``p`` tokens, so it proves less about the handoff.
    """
    s = list(stream)
    for p in range(1, max_period + 1):
        if len(s) >= p + min_run and s[-min_run:] == s[-min_run - p : -p]:
            return p
    return None


def _request_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for rec in records:
        toks = sorted(rec["tokens"], key=lambda t: t[1])
        times = [t[0] for t in sorted(rec["tokens"])]
        gaps = np.diff(times) if len(times) > 1 else np.zeros(1)
        rows.append(
            {
                "phase": rec["phase"],
                "req": f"s{rec['session']}t{rec['turn']}",
                "route": rec.get("route", "-"),
                "hit": rec.get("hit_blocks", 0) / max(rec.get("blocks", 1), 1),
                "ttft_ms": 1e3 * times[0] if times else float("nan"),
                "rld_tok": sum(1 for t in toks if t[3] == "relay"),
                "md_tok": sum(1 for t in toks if t[3] == "main"),
                "max_gap_ms": 1e3 * float(gaps.max()),
                "outcome": rec["outcome"] or "lost",
            }
        )
    return rows


def summarize(
    records: list[dict[str, Any]],
    refs: dict[int, list[int]],
    stats: dict[str, Any],
    *,
    expected: int,
) -> dict[str, Any]:
    """The demo's summary from the front end's records and the reference streams.

    Args:
        records: both phases' request records (P's front end).
        refs: each request's reference stream (:func:`reference_streams`).
        stats: each phase's ``{"p", "relay", "main"}`` statistics.
        expected: requests submitted over both phases; any without a record
            counts as lost.

    Returns:
        The summary. ``tokens_match_reference`` is true only if every expected
        request finished with its reference's tokens, in order.
    """
    rows = _request_rows(records)
    by_phase = {ph: [r for r in rows if r["phase"] == ph] for ph in _PHASES}

    def ttfts(phase: str, low: bool | None) -> list[float]:
        return [
            r["ttft_ms"]
            for r, rec in zip(rows, records, strict=True)
            if r["phase"] == phase and (low is None or (rec["turn"] == 0) == low)
        ]

    def ttft(phase: str, low: bool | None) -> float:
        sel = ttfts(phase, low)
        return float(np.median(sel)) if sel else float("nan")

    def ttft_all() -> dict[str, float]:
        # TTFT over all requests of each phase: mean, p90, p99 and how much PDD cuts each
        out: dict[str, float] = {}
        for stat, fn in (
            ("mean", np.mean),
            ("p90", lambda v: np.percentile(v, 90)),
            ("p99", lambda v: np.percentile(v, 99)),
        ):
            got = {ph: float(fn(v)) if (v := ttfts(ph, None)) else float("nan") for ph in _PHASES}
            out[f"ttft_{stat}_ms_all_pdd"] = got["pdd"]
            out[f"ttft_{stat}_ms_all_baseline"] = got["baseline"]
            base = got["baseline"]
            out[f"ttft_{stat}_reduction"] = 1 - got["pdd"] / base if base else float("nan")
        return out

    def tokens(rec: dict[str, Any]) -> list[int]:
        return [t[2] for t in sorted(rec["tokens"], key=lambda t: t[1])]

    positions_ok = all(
        sorted(t[1] for t in rec["tokens"]) == list(range(len(rec["tokens"]))) for rec in records
    )
    match = (
        len(records) == expected
        and positions_ok
        and all(
            rec["outcome"] == "finished" and tokens(rec) == refs[rec["request_id"]]
            for rec in records
        )
    )
    pdd = by_phase["pdd"]
    rld_tokens = sum(r["rld_tok"] for r in pdd)
    all_tokens = sum(r["rld_tok"] + r["md_tok"] for r in pdd)

    def p_stat(phase: str, name: str) -> int:
        return int(stats.get(phase, {}).get("p", {}).get("statistics", {}).get(name, 0))

    relay_reqs = stats.get("pdd", {}).get("relay", {}).get("requests", [])
    rounds = [r.get("rounds", 0) for r in relay_reqs]
    held = sum(r.get("playout_tokens", 0) for r in relay_reqs)
    held_s = sum(r.get("playout_total_s", 0.0) for r in relay_reqs)

    def completion_ms(phase: str) -> float:
        # mean time from submission to a request's last token
        ends = [
            max(t[0] for t in rec["tokens"])
            for rec in records
            if rec["phase"] == phase and rec["tokens"]
        ]
        return 1e3 * float(np.mean(ends)) if ends else float("nan")

    low_pdd, low_base = ttft("pdd", True), ttft("baseline", True)
    wan, saved = p_stat("pdd", "wan_bytes"), p_stat("pdd", "wan_bytes_saved")
    return {
        "requests": len(records),
        "tokens_match_reference": bool(match),
        "lost_requests": expected - len(records) + sum(1 for r in rows if r["outcome"] == "lost"),
        "failed_requests": sum(1 for r in rows if r["outcome"].startswith("error")),
        "periodic_streams": sum(1 for ref in refs.values() if tail_period(ref) is not None),
        "ttft_p50_ms_low_hit_pdd": low_pdd,
        "ttft_p50_ms_low_hit_baseline": low_base,
        "ttft_p50_reduction_low_hit": 1 - low_pdd / low_base if low_base else float("nan"),
        "ttft_p50_ms_all_pdd": ttft("pdd", None),
        "ttft_p50_ms_all_baseline": ttft("baseline", None),
        **ttft_all(),
        "rld_token_share": rld_tokens / all_tokens if all_tokens else 0.0,
        "wan_bytes": wan,
        "wan_bytes_saved_by_drc": saved,
        "wan_saved_fraction": saved / max(wan + saved, 1),
        "wan_bytes_baseline": p_stat("baseline", "wan_bytes"),
        "handoff_rounds_total": int(sum(rounds)),
        "handoff_rounds_max": int(max(rounds, default=0)),
        "max_stall_ms": max((r["max_gap_ms"] for r in pdd), default=0.0),
        "max_stall_ms_baseline": max((r["max_gap_ms"] for r in by_phase["baseline"]), default=0.0),
        # RLD's playout buffer (HandoffParams.playout_s): what it cost, per RLD token it held
        "playout_tokens": int(held),
        "playout_share_of_rld_tokens": held / rld_tokens if rld_tokens else 0.0,
        "playout_added_ms_mean": 1e3 * held_s / held if held else 0.0,
        "playout_added_ms_max": 1e3
        * max((r.get("playout_max_s", 0.0) for r in relay_reqs), default=0.0),
        "completion_ms_mean_pdd": completion_ms("pdd"),
        "completion_ms_mean_baseline": completion_ms("baseline"),
    }


def timeline_figure(records: list[dict[str, Any]]) -> Any:
    """The timeline plot of both phases (a matplotlib Figure; the legend is
    above the plots, outside the data)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 6), sharex=True)
    colors = {"relay": "tab:orange", "main": "tab:blue"}
    for ax, phase in zip(axes, _PHASES, strict=True):
        recs = [r for r in records if r["phase"] == phase]
        for i, rec in enumerate(recs):
            for src in ("relay", "main"):
                xs = [1e3 * t[0] for t in rec["tokens"] if t[3] == src]
                ax.scatter(xs, [i] * len(xs), s=4, color=colors[src])
            if rec["tokens"]:
                ax.plot([0, 1e3 * min(t[0] for t in rec["tokens"])], [i, i], color="0.7", lw=1)
        ax.set_title("P->RLD->MD (pddnet routing)" if phase == "pdd" else "P->MD only (baseline)")
        ax.set_xlabel("ms since the request was submitted")
        ax.set_ylabel("request, in submission order")
    handles = [
        *(
            plt.Line2D([], [], ls="", marker="o", color=c, label=f"token from {who}")
            for who, c in (("RLD", colors["relay"]), ("MD", colors["main"]))
        ),
        plt.Line2D([], [], color="0.7", label="waiting for the first token"),
    ]
    fig.legend(handles=handles, loc="upper center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.94))  # the top strip holds the legend
    return fig


def _plot(records: list[dict[str, Any]], path: str) -> None:
    fig = timeline_figure(records)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def main(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    cfg = run_config(args)
    print(
        f"pddnet demo: {cfg['sessions']} sessions x {cfg['turns']} turns per phase, "
        f"{cfg['max_tokens']} tokens each"
        + (f" ({cfg['first_turn_tokens']} on first turns), " if args.engine == "vllm" else ", ")
        + (
            "vLLM CPU engines (decode at vLLM's own speed); "
            if args.engine == "vllm"
            else f"decode paced to {args.step_ms:g} ms/step; "
        )
        + f"P->RLD local path asked: --local-path {args.local_path}"
    )
    log: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        references = reference_streams
        zygote = None
        if args.engine == "vllm":
            # first: its imports (~10 CPU s) overlap the model's build and the UCX probe
            env = {
                **os.environ,
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", K_VLLM_THREADS),
            }
            zygote = stack.enter_context(Zygote(env))
            cfg["model"] = str(build_tiny_llama(Path(tmp) / "model"))

            def references(records: list[dict[str, Any]]) -> dict[int, list[int]]:
                assert zygote is not None
                return vllm_reference_streams(records, cfg["model"], Path(tmp), zygote.spawner())

        link, phases = _run(args, cfg, Path(tmp), log, zygote)
        expected = 2 * cfg["sessions"] * cfg["turns"]
        return report(phases, link, args, expected=expected, t0=t0, references=references)


def report(
    phases: dict[str, Any],
    link: str,
    args: argparse.Namespace,
    *,
    expected: int,
    t0: float,
    references: Callable[[list[dict[str, Any]]], dict[int, list[int]]] = reference_streams,
) -> int:
    """Check, print and write the phases' results (``args.png``, ``args.json``).

    Args:
        phases: each phase's ``{"requests", "stats"}`` as P's front end wrote them.
        link: the link's description.
        args: the demo's command line.
        expected: requests submitted over both phases.
        t0: ``time.monotonic()`` when the demo started.
        references: each record's reference stream (:func:`reference_streams`,
            or :func:`vllm_reference_streams` for ``--engine vllm``).

    Returns:
        The exit status: 0 only if every expected request finished with its
        reference tokens (``tokens_match_reference``), else 1.
    """
    records = [rec for ph in _PHASES for rec in phases[ph]["requests"]]
    stats = {ph: phases[ph]["stats"] for ph in _PHASES}
    print("checking every stream against single-instance greedy decoding ...")
    refs = references(records)
    print_table(_request_rows(records), title=f"\nper-request timeline ({link})")
    summary = summarize(records, refs, stats, expected=expected)
    summary["link"] = link
    summary.update(local_path_summary(phases))
    summary["elapsed_s"] = time.monotonic() - t0
    print()
    print_table([{"metric": k, "value": v} for k, v in summary.items()], title="summary")
    if args.png:
        _plot(records, args.png)
        print(f"timeline plot: {args.png}")
    write_report(
        args.json,
        summary,
        records=records,
        stats=stats,
        ttft_ms=percentiles([r["ttft_ms"] for r in _request_rows(records)]),
    )
    if not summary["tokens_match_reference"]:
        print(
            f"pddnet demo: FAILED: {summary['failed_requests']} failed and"
            f" {summary['lost_requests']} lost of {expected} requests, or tokens differ"
            " from the reference"
        )
        return 1
    return 0
