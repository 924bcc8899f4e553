"""``pddnet demo``: P, RLD and MD end to end across an emulated WAN.

Three OS processes (``pddnet/demo/_roles.py``) run the engine-facing API
with the reference model as the engine. As root, they live in the emulated
``pdd`` topology (P and RLD in DC-A, MD in DC-B behind a shaped WAN);
otherwise they share loopback, and the demo says so. A stream of skewed
multi-turn requests runs twice on the same link: routed by pddnet
(P->RLD->MD for low-hit requests), then with every request on P->MD (the
baseline). The demo prints a per-request timeline and a summary, writes a PNG
timeline, and checks every request's tokens against single-instance greedy
decoding of the same prompt.

Scale: the tiny reference model's KV is 512 B per token, about 100x less than
a 7B-class model's, so the default WAN runs at 25 Mbit/s to keep the ratio of
KV transfer time to decode time realistic, and decode steps are paced to
20 ms (50 tokens/s) like a real model's.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..bench._common import percentiles, print_table, pyplot, write_report
from ..emu import emulated_wan, parse_duration, parse_rate, unavailable_reason
from ..recompute import TINY, ReferenceModel, greedy

__all__ = ["add_arguments", "main", "reference_streams", "summarize"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer sessions (CI)")
    parser.add_argument("--json", metavar="PATH", help="write the summary and records as JSON")
    parser.add_argument(
        "--png",
        metavar="PATH",
        default="out/demo-timeline.png",
        help="timeline plot (default: %(default)s)",
    )
    parser.add_argument("--sessions", type=int, default=None, help="sessions per phase")
    parser.add_argument("--turns", type=int, default=4, help="turns per session")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rtt", default="30ms")
    parser.add_argument("--rate", default="25mbit")
    parser.add_argument("--loss", default="0")
    parser.add_argument("--step-ms", type=float, default=20.0, help="paced decode step")
    parser.add_argument("--loopback", action="store_true", help="skip the emulated WAN")
    parser.add_argument(
        "--local-path",
        choices=("tcp", "ucx"),
        default="tcp",
        help="P->RLD transport (default %(default)s; UCX needs ucxx)",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(args: argparse.Namespace, out: str) -> dict[str, Any]:
    return {
        "blocks": 8192,
        "step_time_s": args.step_ms / 1000,
        "rtt_s": parse_duration(args.rtt),
        "rate_bps": parse_rate(args.rate),
        "ttft_target_s": 0.15,
        "sessions": args.sessions or (4 if args.quick else 8),
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "seed": 7,
        "request_timeout_s": 60.0,
        "out": out,
        "local_path": args.local_path,
    }


_ROLES = ("prefill", "relay", "main")


def _spawn_roles(
    cfg: dict[str, Any],
    addrs: dict[str, str],
    ports: dict[str, int],
    spawners: dict[str, Callable[..., subprocess.Popen[str]]],
) -> list[subprocess.Popen[str]]:
    """Start the three role processes (P first: it hosts the rendezvous)."""
    env = {**os.environ, "PDDNET_SECRET": secrets.token_hex(32)}
    procs = []
    for role in _ROLES:
        rcfg = {
            **cfg,
            "control": f"tcp://{addrs[role]}:{ports[role]}",
            "data_host": addrs[role],
            "rendezvous": f"tcp://{addrs['prefill']}:{ports['prefill']}",
        }
        argv = [sys.executable, "-m", "pddnet.demo._roles", role, json.dumps(rcfg)]
        procs.append(
            spawners[role](
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return procs


def _run(args: argparse.Namespace, cfg: dict[str, Any], log: list[str]) -> str:
    reason = "--loopback was given" if args.loopback else unavailable_reason()
    if reason is None:
        with emulated_wan(args.rtt, rate=args.rate, loss=args.loss, mtu=1500) as wan:
            hosts = {"prefill": wan.p, "relay": wan.rld, "main": wan.md}
            # each role runs in its host's namespace; the testbed kills them on teardown
            procs = _spawn_roles(
                cfg,
                {r: h.addr for r, h in hosts.items()},
                dict(zip(_ROLES, (5550, 5551, 5552), strict=True)),
                {r: h.spawn for r, h in hosts.items()},
            )
            _follow(procs, log)
        return f"emulated WAN ({wan.backend}): rtt {args.rtt}, rate {args.rate}, loss {args.loss}"
    print(
        f"pddnet demo: no emulated WAN here ({reason}); running on loopback, where the WAN"
        " is not shaped and RLD has nothing to mask."
    )
    addrs = dict.fromkeys(_ROLES, "127.0.0.1")
    procs = _spawn_roles(
        cfg, addrs, {r: _free_port() for r in _ROLES}, dict.fromkeys(_ROLES, subprocess.Popen)
    )
    try:
        _follow(procs, log)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return "loopback (no WAN emulation)"


def _follow(procs: list[subprocess.Popen[str]], log: list[str], timeout: float = 600) -> None:
    """Relay P's progress lines until P exits; the decoders are then stopped."""
    p = procs[0]
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    for line in p.stdout:
        line = line.rstrip()
        log.append(line)
        if "turn" not in line:
            print(f"  {line}")
        else:
            sys.stdout.write(f"\r  {line[:90]:<90}")
            sys.stdout.flush()
        if time.monotonic() > deadline:
            break
    print()
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
    records: list[dict[str, Any]], refs: dict[int, list[int]], stats: dict[str, Any]
) -> dict[str, Any]:
    """The demo's summary from the front end's records and the reference streams."""
    rows = _request_rows(records)
    by_phase = {ph: [r for r in rows if r["phase"] == ph] for ph in ("pdd", "baseline")}

    def ttft(phase: str, low: bool | None) -> float:
        sel = [
            r["ttft_ms"]
            for r, rec in zip(rows, records, strict=True)
            if r["phase"] == phase and (low is None or (rec["turn"] == 0) == low)
        ]
        return float(np.median(sel)) if sel else float("nan")

    match = all(
        [t[2] for t in sorted(rec["tokens"], key=lambda t: t[1])] == refs[rec["request_id"]]
        for rec in records
        if rec["outcome"] == "finished"
    )
    positions_ok = all(
        sorted(t[1] for t in rec["tokens"]) == list(range(len(rec["tokens"]))) for rec in records
    )
    pdd = by_phase["pdd"]
    rld_tokens = sum(r["rld_tok"] for r in pdd)
    all_tokens = sum(r["rld_tok"] + r["md_tok"] for r in pdd)
    p_stats = stats.get("p", {}).get("statistics", {})
    relay_reqs = stats.get("relay", {}).get("requests", [])
    rounds = [r.get("rounds", 0) for r in relay_reqs]
    low_pdd, low_base = ttft("pdd", True), ttft("baseline", True)
    return {
        "requests": len(records),
        "tokens_match_reference": bool(match and positions_ok),
        "lost_requests": sum(1 for r in rows if r["outcome"] == "lost"),
        "failed_requests": sum(1 for r in rows if r["outcome"].startswith("error")),
        "ttft_p50_ms_low_hit_pdd": low_pdd,
        "ttft_p50_ms_low_hit_baseline": low_base,
        "ttft_p50_reduction_low_hit": 1 - low_pdd / low_base if low_base else float("nan"),
        "ttft_p50_ms_all_pdd": ttft("pdd", None),
        "ttft_p50_ms_all_baseline": ttft("baseline", None),
        "rld_token_share": rld_tokens / all_tokens if all_tokens else 0.0,
        "wan_bytes": p_stats.get("wan_bytes", 0),
        "wan_bytes_saved_by_drc": p_stats.get("wan_bytes_saved", 0),
        "wan_saved_fraction": p_stats.get("wan_bytes_saved", 0)
        / max(p_stats.get("wan_bytes", 0) + p_stats.get("wan_bytes_saved", 0), 1),
        "handoff_rounds_total": int(sum(rounds)),
        "handoff_rounds_max": int(max(rounds, default=0)),
        "max_stall_ms": max((r["max_gap_ms"] for r in pdd), default=0.0),
        "max_stall_ms_baseline": max((r["max_gap_ms"] for r in by_phase["baseline"]), default=0.0),
    }


def _plot(records: list[dict[str, Any]], path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 6), sharex=True)
    colors = {"relay": "tab:orange", "main": "tab:blue"}
    for ax, phase in zip(axes, ("pdd", "baseline"), strict=True):
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
    for src, c in colors.items():
        axes[0].scatter([], [], color=c, label=f"token from {'RLD' if src == 'relay' else 'MD'}")
    axes[0].plot([], [], color="0.7", label="waiting for the first token")
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "records.json")
        cfg = _config(args, out)
        print(
            f"pddnet demo: {cfg['sessions']} sessions x {cfg['turns']} turns per phase, "
            f"{cfg['max_tokens']} tokens each, decode paced to {args.step_ms:g} ms/step"
        )
        log: list[str] = []
        link = _run(args, cfg, log)
        data = json.loads(Path(out).read_text())
    records, stats = data["requests"], data["stats"]
    print("checking every stream against single-instance greedy decoding ...")
    refs = reference_streams(records)
    print_table(_request_rows(records), title=f"\nper-request timeline ({link})")
    summary = summarize(records, refs, stats)
    summary["link"] = link
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
    ok = summary["tokens_match_reference"] and summary["lost_requests"] == 0
    return 0 if ok else 1
