"""Handoff overhead: token ids + recompute on MD vs shipping the incremental KV over the WAN.

The source's central microbenchmark (100-token relay): shipping the KV of the
eager tokens over WAN Ethernet moves 4649 KB (mean 185 ms, max 512.6 ms, plus
24.5 ms device copy); sending the token ids (about 1.5 KB) and recomputing on
MD takes 305 ms mean, 321.4 ms max, 4.8 ms std. This benchmark measures both
on a link of your choosing, in the same run, with real processes: MD in DC-B
(``dc-b-md``), RLD in DC-A (``dc-a-rld``) on the emulated WAN of
:mod:`pddnet.emu` (loopback, said plainly, where namespaces are unavailable).

* ship-KV: the N tokens' KV (token-granular byte ranges, B bytes per token)
  over :class:`~pddnet.transport.wan.WanSender` into MD's pool, until MD has
  it in place and says so (``KvReady``);
* token-IDs: a ``TokenBatch`` control frame; MD runs one ``extend`` of the N
  tokens over its prompt KV with :mod:`pddnet.recompute` (NumPy, or CuPy with a
  GPU) and acks (``HandoffAck``).

Both latencies are taken on RLD's clock and end with a control message from MD
(see :mod:`pddnet.bench._handoff_peer`). RLD reaches MD's control plane over two
TCP connections by default (``--control-paths``: every control frame of both
methods travels once per path, the first copy wins, so a lost one-packet
message does not wait for TCP's tail-loss probe); the token payload counts
every copy. ``--tcp`` is one setting for both methods: the WAN TCP options
(5 ms RTO floor and delayed-ACK ceiling) go on the control connections *and*
on the KV's data streams, or on neither.

Like with like: MD recomputes with the model whose KV is shipped. By default
that is 46.5 KiB/token = 31 layers x 3 KV heads x 64 in float32, completed
into a whole model by :func:`~pddnet.bench._handoff_plan.model_of_kv` (12
query heads, width 768, SwiGLU 2048: 0.24 B parameters), measured on this
machine's CPU (NumPy). Beside it the report gives a cost model of the same
recompute on a GPU (:func:`~pddnet.bench._handoff_plan.gpu_recompute_s`),
labelled as a model, never mixed with the measurement. ``--sweep`` runs N from
1 to 512 on several links and finds where recompute starts to win (only when
the two sides are the same model). docs/handoff-bench.md has the results and
the discussion.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import secrets
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .._errors import LocalProtocolError, TransportError
from ._common import (
    K_EMU_HOW,
    Progress,
    add_common_arguments,
    print_missing,
    print_table,
    pyplot,
    write_report,
)
from ._handoff_plan import (
    K_DEFAULT_GROUP,
    K_DEFAULT_KV_BYTES_PER_TOKEN,
    K_DEFAULT_VOCAB,
    K_H100_SXM,
    K_QUICK_LINK,
    LinkConditions,
    ModelChoice,
    crossover,
    gpu_recompute_s,
    model_for_bytes,
    model_params,
    parse_model,
    parse_wan,
    summary_stats,
)

K_SWEEP_TOKENS = (1, 4, 16, 64, 100, 128, 256, 512)
K_SWEEP_LINKS = (
    LinkConditions(0.030, 0.002, 0.001, 1e9),
    K_QUICK_LINK,
    LinkConditions(0.080, 0.005, 0.01, 200e6),
)
K_PEER_TIMEOUT = 30.0
K_DEFAULT_WAN = "rtt=30ms,jitter=5ms,loss=0.1%,rate=1gbit"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--tokens", type=int, default=100, help="eager tokens handed over (N)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=None,
        metavar="B",
        help=f"KV bytes per token (default {K_DEFAULT_KV_BYTES_PER_TOKEN} = 46.5 KiB)",
    )
    group.add_argument(
        "--model",
        default=None,
        metavar="tiny|SHAPE",
        help="derive B from a KVLayout: tiny, or layers=32,kv_heads=8,head_dim=128,dtype=float16",
    )
    parser.add_argument(
        "--wan",
        default=None,
        help=f"link: rtt=,jitter=,loss=,rate=[,mtu=] (default {K_DEFAULT_WAN.replace('%', '%%')}; "
        "quick: "
        "rtt=30ms,jitter=2ms,loss=0.5%%,rate=200mbit; with --sweep: only this link)",
    )
    parser.add_argument("--repeat", type=int, default=None, help="measured repetitions per point")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured repetitions first")
    parser.add_argument("--sweep", action="store_true", help="N from 1 to 512 on several links")
    parser.add_argument("--loopback", action="store_true", help="skip the emulated WAN")
    parser.add_argument("--prefix", type=int, default=256, help="prompt tokens MD already holds")
    parser.add_argument(
        "--group",
        type=int,
        default=K_DEFAULT_GROUP,
        help="query heads per KV head of the model whose KV is shipped (its width follows)",
    )
    parser.add_argument("--vocab", type=int, default=K_DEFAULT_VOCAB, help="vocabulary size")
    parser.add_argument("--streams", type=int, default=8, help="WAN sender TCP streams")
    parser.add_argument("--chunk", type=int, default=1 << 20, help="WAN chunk size, bytes")
    parser.add_argument("--gap", type=float, default=0.05, help="idle seconds between handoffs")
    parser.add_argument(
        "--control-paths",
        type=int,
        default=2,
        help="TCP connections RLD opens to MD's control plane; every control frame of both "
        "methods travels once per path, the first copy wins (1: a single connection)",
    )
    parser.add_argument(
        "--tcp",
        choices=("default", "wan"),
        default="wan",
        help="TCP options of every connection of both methods (control and KV data streams): "
        "the system's, or wan (RTO floor and delayed-ACK ceiling of 5 ms, Linux 6.15+; see "
        "pddnet.control.TcpTuning)",
    )
    parser.add_argument("--device", choices=("auto", "numpy", "cupy"), default="auto")
    parser.add_argument(
        "--md-nice",
        type=int,
        default=0,
        help="nice increment for MD (e.g. -10 as root: recompute ahead of other load)",
    )
    parser.add_argument("--seed", type=int, default=0)


def _device(want: str) -> str:
    if want != "auto":
        return want
    from .._optional import available

    if not available("cupy"):
        return "numpy"
    try:
        import cupy

        return "cupy" if cupy.cuda.runtime.getDeviceCount() > 0 else "numpy"
    except Exception:
        return "numpy"


def _choice(args: argparse.Namespace) -> ModelChoice:
    if args.model:
        return parse_model(args.model, group=args.group, vocab=args.vocab)
    b = args.kv_bytes_per_token or K_DEFAULT_KV_BYTES_PER_TOKEN
    return model_for_bytes(b, group=args.group, vocab=args.vocab)


# -- processes ----------------------------------------------------------------------


class _Peer:
    """A peer process whose stdout JSON lines a thread puts on a queue."""

    def __init__(self, proc: subprocess.Popen[str], name: str) -> None:
        self.proc = proc
        self.name = name
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read_out, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def next(self, timeout: float) -> dict[str, Any]:
        try:
            item = self.lines.get(timeout=timeout)
        except queue.Empty:
            item = None
        if item is None:
            tail = "".join(self.stderr[-20:])
            raise TransportError(f"{self.name} ended or stalled:\n{tail}", peer=self.name)
        return item

    def drain(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            try:
                item = self.lines.get_nowait()
            except queue.Empty:
                return out
            if item is not None:
                out.append(item)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _argv(role: str, cfg: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "pddnet.bench._handoff_peer", role, json.dumps(cfg)]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


@contextlib.contextmanager
def _hosts(link: LinkConditions, emulate: bool) -> Iterator[tuple[Any, Any, str, str]]:
    """(spawn on MD, spawn on RLD, MD address, backend) for one link."""
    if not emulate:
        yield subprocess.Popen, subprocess.Popen, "127.0.0.1", "loopback"
        return
    from ..emu import emulated_wan

    with emulated_wan(
        link.rtt_s,
        rate=link.rate_bps,
        loss=link.loss,
        jitter=link.jitter_s,
        mtu=link.mtu,
    ) as wan:
        yield wan.md.spawn, wan.rld.spawn, wan.md.addr, wan.backend


def run_link(
    link: LinkConditions,
    choice: ModelChoice,
    tokens: list[int],
    args: argparse.Namespace,
    *,
    emulate: bool,
    device: str,
    advance: Callable[[], None],
) -> dict[str, Any]:
    """Run MD and RLD on one link for every token count; returns their measurements."""
    secret = secrets.token_bytes(32).hex()
    common = {
        "secret": secret,
        "kv_layout": choice.kv_layout.to_dict(),
        "prefix_len": args.prefix,
        "seed": args.seed,
    }
    md_cfg = {
        **common,
        "model": choice.model.to_dict(),
        "shared_pool": choice.shared_pool,
        "max_tokens": max(tokens),
        "device": device,
        "nice": args.md_nice,
        "tcp": args.tcp,
        "bind": "0.0.0.0" if emulate else "127.0.0.1",
    }
    with _hosts(link, emulate) as (spawn_md, spawn_rld, md_addr, backend):
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": _env()}
        md = _Peer(spawn_md(_argv("md", md_cfg), **pipes), "md")
        rld = None
        try:
            ready = md.next(K_PEER_TIMEOUT + 60)["ready"]
            rld_cfg = {
                **common,
                "md_control": f"tcp://{md_addr}:{ready['control_port']}",
                "md_wan": f"{md_addr}:{ready['wan_port']}",
                "tokens": tokens,
                "repeat": args.repeat,
                "warmup": args.warmup,
                "vocab": choice.model.vocab_size,
                "streams": args.streams,
                "chunk": args.chunk,
                "gap": args.gap,
                "control_paths": args.control_paths,
                "tcp": args.tcp,
            }
            rld = _Peer(spawn_rld(_argv("rld", rld_cfg), **pipes), "rld")
            while True:
                msg = rld.next(K_PEER_TIMEOUT + 10 * max(tokens) * 0.05)
                if "progress" in msg:
                    advance()
                elif "result" in msg:
                    result: dict[str, Any] = msg["result"]
                    break
        finally:
            if rld is not None:
                rld.stop()
            md.stop()
        md_lines = [m["md"] for m in md.drain() if "md" in m]
    result["backend"] = backend
    result["control_paths"] = args.control_paths
    result["link"] = link.to_dict() if emulate else {"name": "loopback (unshaped)"}
    result["md"] = md_lines
    return result


# -- reporting -------------------------------------------------------------------------


def _rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for res in results:
        for pt in res["points"]:
            for method, key, payload in (
                ("ship-KV", "kv_s", pt["kv_payload_bytes"]),
                ("token-IDs", "token_s", pt["token_payload_bytes"]),
            ):
                st = summary_stats(pt[key])
                rows.append(
                    {
                        "link": res["link"]["name"],
                        "N": pt["tokens"],
                        "method": method,
                        "payload_B": payload,
                        **{f"{k}_ms": st[k] * 1e3 for k in ("mean", "p50", "p99", "max", "std")},
                        "cv": st["cv"],
                    }
                )
    return rows


def _md_times(res: dict[str, Any], key: str, rids: list[int] | None = None) -> list[float]:
    """MD's own ``compute_s``/``copy_s`` of the measured repetitions (``rids``), in order."""
    by_rid = {int(m["rid"]): float(m[key]) for m in res["md"] if key in m}
    if rids is None:
        return list(by_rid.values())
    return [by_rid[r] for r in rids if r in by_rid]


def _plot_cdf(path: str, results: list[dict[str, Any]], n: int) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in results:
        for pt in res["points"]:
            if pt["tokens"] != n:
                continue
            for key, label, style in (("kv_s", "ship KV", "-"), ("token_s", "token IDs", "--")):
                xs = np.sort(np.asarray(pt[key]) * 1e3)
                ys = np.arange(1, xs.size + 1) / max(xs.size, 1)
                ax.step(xs, ys, style, where="post", label=f"{label} ({res['link']['name']})")
    ax.set_xlabel(f"handoff latency of {n} tokens, ms")
    ax.set_ylabel("CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("token IDs + recompute vs shipping incremental KV")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_sweep(path: str, results: list[dict[str, Any]], cross: dict[str, Any]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, res in enumerate(results):
        c = colors[i % len(colors)]
        ns = [pt["tokens"] for pt in res["points"]]
        for key, style, label in (("kv_s", "-o", "ship KV"), ("token_s", "--s", "token IDs")):
            mean = [np.mean(pt[key]) * 1e3 for pt in res["points"]]
            p99 = [np.percentile(pt[key], 99) * 1e3 for pt in res["points"]]
            ax.plot(ns, mean, style, color=c, ms=4, label=f"{label} mean, {res['link']['name']}")
            ax.plot(ns, p99, ":", color=c, lw=0.8)
        x = cross.get(res["link"]["name"], {}).get("mean")
        if x is not None:
            ax.axvline(x, color=c, lw=0.8, alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens handed over (N)")
    ax.set_ylabel("latency, ms (dotted: p99; vertical: crossover of means)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)
    ax.set_title("where recompute beats KV shipping")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _decompose(res: dict[str, Any], pt: dict[str, Any]) -> dict[str, float]:
    """Split the token-ID latency into MD's recompute and the rest (network, framing)."""
    compute = _md_times(res, "compute_s", pt["request_ids"])
    copy = _md_times(res, "copy_s", pt["request_ids"])
    out = {"md_copy_mean_ms": float(np.mean(copy)) * 1e3 if copy else float("nan")}
    if len(compute) != len(pt["token_s"]):
        return out
    c = summary_stats(compute)
    rest = summary_stats([t - x for t, x in zip(pt["token_s"], compute, strict=True)])
    out.update(
        {
            "md_compute_mean_ms": c["mean"] * 1e3,
            "md_compute_min_ms": c["min"] * 1e3,
            "md_compute_cv": c["cv"],
            "recompute_other_mean_ms": rest["mean"] * 1e3,
            "recompute_other_cv": rest["cv"],
            "recompute_other_max_ms": rest["max"] * 1e3,
        }
    )
    return out


def _tcp_stats(res: dict[str, Any]) -> dict[str, Any]:
    """The one TCP setting and where it took: control connections, both ends' KV streams."""
    out: dict[str, Any] = dict(res.get("tcp", {}))
    grants = [m["wan_rto_min_us"] for m in res["md"] if "wan_rto_min_us" in m]
    out["wan_rto_min_us_md"] = grants[-1] if grants else []
    out["wan_rto_min_us_rld"] = out.pop("wan_rto_min_us", [])
    return out


def _gpu_model(
    res: dict[str, Any], pt: dict[str, Any], choice: ModelChoice, prefix: int
) -> dict[str, Any]:
    """Token-ID latency with MD's measured CPU recompute replaced by the GPU cost model.

    A model, not a measurement: the measured non-compute part (network, framing)
    plus :func:`gpu_recompute_s` of the same model and N.
    """
    compute = _md_times(res, "compute_s", pt["request_ids"])
    gpu_s = gpu_recompute_s(choice.model, pt["tokens"], prefix)
    out: dict[str, Any] = {"device": K_H100_SXM.name, "recompute_ms": gpu_s * 1e3}
    if len(compute) == len(pt["token_s"]):
        rest = float(np.mean(pt["token_s"]) - np.mean(compute))
        out["token_ids_mean_ms"] = (rest + gpu_s) * 1e3
    return out


def _control_stats(res: dict[str, Any]) -> dict[str, Any]:
    """RLD's control-plane counters, plus the duplicate copies MD dropped."""
    out: dict[str, Any] = dict(res.get("control", {}))
    md = [m for m in res["md"] if "control_duplicates" in m]
    if md:
        out["md_duplicates_dropped"] = md[-1]["control_duplicates"]
        out["md_copies_sent"] = md[-1]["control_copies_sent"]
    return out


def _summary(
    results: list[dict[str, Any]], n: int, choice: ModelChoice, args: argparse.Namespace
) -> dict[str, Any]:
    res = results[0]
    pt = next((p for p in res["points"] if p["tokens"] == n), res["points"][0])
    kv, tok = summary_stats(pt["kv_s"]), summary_stats(pt["token_s"])
    s: dict[str, Any] = {}
    if pt["tokens"] == 100:
        s["token_payload_bytes_100"] = pt["token_payload_bytes"]  # all copies
        s["kv_payload_bytes_100"] = pt["kv_payload_bytes"]
    s.update(
        {
            "tokens": pt["tokens"],
            "token_payload_bytes": pt["token_payload_bytes"],
            "token_frame_bytes": pt.get("token_frame_bytes", pt["token_payload_bytes"]),
            "control_paths": res.get("control_paths", 1),
            "control": _control_stats(res),
            "tcp": _tcp_stats(res),
            "kv_payload_bytes": pt["kv_payload_bytes"],
            "kv_wire_bytes_mean": float(np.mean(pt["kv_wire_bytes"])),
            "recompute_cv": tok["cv"],
            "kv_ship_cv": kv["cv"],
            "kv_ship_max_over_mean": kv["max_over_mean"],
            "recompute_max_over_mean": tok["max_over_mean"],
            **{f"kv_ship_{k}_ms": kv[k] * 1e3 for k in ("mean", "p50", "p99", "max", "std")},
            **{f"recompute_{k}_ms": tok[k] * 1e3 for k in ("mean", "p50", "p99", "max", "std")},
            **_decompose(res, pt),
            "kv_bytes_per_token": choice.kv_bytes_per_token,
            "model": _model_name(choice),
            "same_model": choice.same_model,
            "recompute_measured_on": "cpu (numpy)" if args.device != "cupy" else "gpu (cupy)",
            "gpu_cost_model": _gpu_model(res, pt, choice, args.prefix),
            "repeat": len(pt["kv_s"]),
            "link": res["link"]["name"],
            "network": "emulated" if res["backend"] != "loopback" else "loopback",
            "backend": res["backend"],
        }
    )
    return s


def _model_name(choice: ModelChoice) -> str:
    m = choice.model
    return (
        f"{m.num_layers} layers, {m.num_heads} query / {m.num_kv_heads} KV heads of "
        f"{m.head_dim}, width {m.hidden}, SwiGLU {m.intermediate}, vocab {m.vocab_size}: "
        f"{model_params(m) / 1e9:.2f} B parameters"
    )


def _crossovers(results: list[dict[str, Any]], choice: ModelChoice, prefix: int) -> dict[str, Any]:
    """Per link: measured crossovers (mean, p50, p99) and the GPU cost model's (mean)."""
    stats: dict[str, Callable[[Any], Any]] = {
        "mean": np.mean,
        "p50": np.median,
        "p99": lambda a: np.percentile(a, 99),
    }
    cross: dict[str, Any] = {}
    for res in results:
        ns = [pt["tokens"] for pt in res["points"]]
        kv = [pt["kv_s"] for pt in res["points"]]
        row = {
            s: crossover(ns, [fn(k) for k in kv], [fn(pt["token_s"]) for pt in res["points"]])
            for s, fn in stats.items()
        }
        gpu = [_gpu_model(res, pt, choice, prefix).get("token_ids_mean_ms") for pt in res["points"]]
        if all(g is not None for g in gpu):
            gpu_s = [float(g) / 1e3 for g in gpu if g is not None]
            row["gpu_model_mean"] = crossover(ns, [np.mean(k) for k in kv], gpu_s)
        cross[res["link"]["name"]] = row
    return cross


def main(args: argparse.Namespace) -> int:
    if args.tokens < 1:
        raise LocalProtocolError("--tokens must be at least 1")
    if not 1 <= args.control_paths <= 4:
        raise LocalProtocolError("--control-paths must be 1..4")
    choice = _choice(args)
    device = _device(args.device)
    if args.repeat is None:
        # quick: 30 pairs (about a minute with the 0.24 B model's CPU recompute)
        args.repeat = 30 if args.quick and not args.sweep else (10 if args.sweep else 50)
    if args.sweep:
        tokens = [1, 16, 100, 256] if args.quick else list(K_SWEEP_TOKENS)
        if args.wan:
            links = [parse_wan(args.wan)]
        else:
            links = [K_QUICK_LINK] if args.quick else list(K_SWEEP_LINKS)
    else:
        tokens = [args.tokens]
        if args.wan:
            links = [parse_wan(args.wan)]
        else:
            links = [K_QUICK_LINK if args.quick else parse_wan(K_DEFAULT_WAN)]
    fallback = ""
    if args.loopback:
        fallback = "--loopback given"
    else:
        from ..emu import unavailable_reason

        fallback = unavailable_reason() or ""
    emulate = not fallback
    missing: dict[str, str] = {}
    if fallback and not args.loopback:
        missing["emulated WAN"] = f"{fallback}: measured on loopback; {K_EMU_HOW}"
    if args.device == "auto" and device == "numpy":
        missing["cupy"] = (
            "no CUDA device with CuPy: recompute measured with NumPy on the CPU, the GPU"
            " figures are a cost model; on a CUDA host: pip install -e '.[gpu]'"
        )
    if not emulate:
        print(
            f"NOTE: no emulated WAN ({fallback}): running on LOOPBACK, unshaped; "
            "the link conditions are NOT applied",
            file=sys.stderr,
        )
        links = links[:1]
    if choice.note:
        print(f"NOTE: {choice.note}", file=sys.stderr)
    print(
        f"KV {choice.kv_bytes_per_token} B/token ({choice.kv_layout.num_layers} layers); "
        f"recompute (same model: {choice.same_model}): {_model_name(choice)}, on {device}; "
        f"prompt {args.prefix} tokens; TCP options {args.tcp} on control and KV connections",
        file=sys.stderr,
    )
    total = len(links) * len(tokens) * args.repeat
    results = []
    with Progress(total, "bench handoff") as bar:
        for link in links:
            results.append(
                run_link(
                    link,
                    choice,
                    tokens,
                    args,
                    emulate=emulate,
                    device=device,
                    advance=bar.advance,
                )
            )
    rows = _rows(results)
    print_table(rows, title="handoff latency (RLD clock; payload = bytes on the wire per handoff)")
    print_missing(missing)
    n_main = 100 if 100 in tokens else tokens[0]
    summary = _summary(results, n_main, choice, args)
    summary["device"] = device
    summary["fallback"] = fallback or None
    if missing:
        summary["missing_peers"] = missing
    gm = summary["gpu_cost_model"]
    print_table(
        [
            {
                "N": summary["tokens"],
                "recompute_ms (model)": gm["recompute_ms"],
                "token-IDs mean_ms (model)": gm.get("token_ids_mean_ms"),
                "ship-KV mean_ms (measured)": summary["kv_ship_mean_ms"],
            }
        ],
        title=f"\nGPU COST MODEL, not a measurement ({gm['device']}; token-IDs = measured "
        "non-compute part + modelled recompute of the same model)",
    )
    cross: dict[str, Any] = {}
    if args.sweep and not choice.same_model:
        print("\nNOTE: no crossover: the recomputed model is not the one whose KV is shipped")
    elif args.sweep:
        cross = _crossovers(results, choice, args.prefix)
        print_table(
            [{"link": k, **{f"crossover_{s}_N": v[s] for s in v}} for k, v in cross.items()],
            title=f"\nrecompute wins from N = (None: not up to the largest N; measured on "
            f"{device}; gpu_model: the cost model above) for {_model_name(choice)}",
        )
        summary["crossover"] = cross
    if fallback:
        print(f"\nNOTE: measured on loopback, not an emulated WAN ({fallback})")
    print("\nsummary:", json.dumps(summary, indent=1, default=str))
    write_report(
        args.json,
        summary,
        model=choice.to_dict(),
        rows=rows,
        results=results,
        published={
            "kv_payload_kb": 4649,
            "kv_mean_ms": 185,
            "kv_max_ms": 512.6,
            "kv_device_copy_ms": 24.5,
            "token_payload_kb": 1.5,
            "recompute_mean_ms": 305,
            "recompute_max_ms": 321.4,
            "recompute_std_ms": 4.8,
        },
    )
    if args.png:
        if args.sweep:
            _plot_sweep(args.png, results, cross)
        else:
            _plot_cdf(args.png, results, n_main)
    return 0
