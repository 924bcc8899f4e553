"""The vLLM connector's own cost: its KV load rate and its scheduler-side time.

**Load rate.** :func:`~pddnet.integrations.vllm.copy_blocks`, as
``DecodeKVConnector.start_load_kv`` runs it to move staged blocks into the
blocks vLLM allocated (a ``BlockCopier`` built once for the two pools),
against a plain NumPy copy of the same bytes: one ``np.copyto`` of one
contiguous span of the staging pool into one contiguous span of the
destination pool (the memcpy ceiling). ``same_blocks_ratio_vs_numpy_copy``
times the bare NumPy assignment of exactly the blocks ``copy_blocks`` copies
(one span per layer per block, scattered or not) against that ceiling: what
the destination pattern itself costs, with no Python around it. Both pools have vLLM CPU's
layout (fused ``'hptd'``, K stored ``[d, t]``): the tiny model's (2 layers, 2
KV heads, head dim 64, float32, 32-token blocks: 64 KiB a block) in a staging
pool of 1024 blocks and a destination of 1 GiB (vLLM's cache), and a 7B-like
one (32 layers, 8 KV heads, head dim 128, float16, 32-token blocks: 4 MiB a
block, 1 GiB destination). Destination blocks are ``consecutive`` (one run)
or ``scattered`` (distinct random ids, as vLLM's allocator hands them out);
every copy, on either side, goes to a fresh random place in the destination
pool, so the destination is cold-ish as in a 1 GiB cache. Rounds are paired:
each round times both sides back to back, the order alternating, and
``load_ratio_vs_numpy_copy`` is the median of the per-round ratios of the
median times (``..._worst`` the lowest round). The issue's target is 0.8.

**Scheduler side** (needs vLLM, ``--skip-engine`` leaves it out). Four child
processes (the worker-side connector is a process-wide singleton), each an
in-process vLLM CPU engine over :func:`build_tiny_llama`'s checkpoint: no
connector, a second one without (``control``: what two processes differ by
alone), :class:`PrefillKVConnector` and :class:`DecodeKVConnector`. Each
round runs the same batch of requests (64-token prompts) through ``step()``
on each connector engine and on the no-connector one, back to back, the
order alternating; the per-request overhead is the median over rounds of
(connector time - no-connector time) / requests. P's requests carry pddnet's
hand-off parameters and ``max_tokens=1`` (each finish is a hand-off; no
decoder is connected, so each submit fails on P's endpoint thread and vLLM
frees the blocks, in an untimed drain), against the same requests at
``max_tokens=1`` without a connector; the decoder's (and the control's) run
``K_DECODE_TOKENS`` tokens and name 0 staged tokens (the connector is
consulted for every request, nothing is loaded, so both engines compute the
same tokens). Each engine runs ``--omp-threads`` torch threads (default 1:
with vLLM's one per core, the engines' spinning OpenMP threads turn wall time
into a measure of contention on a small shared machine), and each round
reports its process CPU time and ``engine.step()`` count beside the wall time.
Every pair runs prompts that neither engine has seen: the no-connector engine
runs in every pair, and before it hit its own prefix cache on the second and
third pair of a round, which made each connector look ~0.8-1.4 ms per request
slower (docs/benchmarks.md). The four scheduler hooks
(``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``request_finished``) are also timed directly
inside those runs (a ``perf_counter`` wrapper, whose own cost is counted
against the connector), and once more for the decoder with real loads
(every prompt token staged).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..integrations.vllm import vllm_cpu_layout
from ..integrations.vllm._staging import BlockCopier
from ..kv import KVPool
from ._common import add_common_arguments, print_table, pyplot, write_report

K_TARGET = 0.8  # issue 18: copy_blocks at least 0.8 of a plain NumPy copy
K_POOL_BYTES = 1 << 30  # the destination pool: vLLM's VLLM_CPU_KVCACHE_SPACE=1
K_LAYOUTS = {
    "tiny": vllm_cpu_layout(2, 2, 64, "float32"),
    "7b": vllm_cpu_layout(32, 8, 128, "float16"),
}
K_SIZES = {"tiny": (1, 8, 32, 128, 512), "7b": (1, 8, 32, 128)}
K_QUICK_SIZES = {"tiny": (1, 8, 32, 128, 512), "7b": (1, 8, 32)}
K_PATTERNS = ("consecutive", "scattered")
K_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
)
K_ENGINES = ("none", "control", "prefill", "decode")  # control: a second "none"
K_PROMPT_TOKENS = 64
K_DECODE_TOKENS = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--rounds", type=int, help="paired rounds (default 11, --quick 5)")
    parser.add_argument(
        "--engine-rounds", type=int, help="paired engine rounds (default 31, --quick 15)"
    )
    parser.add_argument("--requests", type=int, default=64, help="requests per engine round")
    parser.add_argument(
        "--skip-engine", action="store_true", help="load rate only (no vLLM needed)"
    )
    parser.add_argument(
        "--omp-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of each engine (default 1; 0: vLLM's own, one per core)",
    )


# ---------------------------------------------------------------- load rate
def _reps(nbytes: int, quick: bool) -> int:
    """Copies per side per round: ~64 MiB (quick) or 256 MiB of traffic, 3..100."""
    return int(np.clip(((64 if quick else 256) << 20) // nbytes, 3, 100))


def _median_s(fn: Callable[..., Any], args: list[tuple[Any, ...]]) -> float:
    """Median time of ``fn(*a)`` over ``args`` (prepared ahead: not timed)."""
    times = []
    for a in args:
        t0 = time.perf_counter()
        fn(*a)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def load_rate(name: str, sizes: tuple[int, ...], rounds: int, quick: bool) -> list[dict[str, Any]]:
    """Paired rounds of copy_blocks vs np.copyto for one layout, every size and pattern."""
    layout = K_LAYOUTS[name]
    bb = layout.block_bytes
    n_dst = K_POOL_BYTES // bb
    staging = KVPool.allocate(layout, max(2 * max(sizes), 1024 if name == "tiny" else 0))
    dst = KVPool.allocate(layout, n_dst)
    for pool in (staging, dst):  # fault the pages in: vLLM's cache is touched memory
        pool.buffers[0].view(np.uint8).fill(1)
    s_flat, d_flat = (p.buffers[0].reshape(-1).view(np.uint8) for p in (staging, dst))
    rng = np.random.default_rng(0)

    copier = BlockCopier(staging, dst)  # as DecodeKVConnector.register_kv_caches builds it

    def ours(src: list[int], ids: list[int]) -> None:
        copier(src, ids)

    def plain(s_span: Any, d_span: Any) -> None:
        np.copyto(d_span, s_span)

    s_buf, d_buf = staging.buffers[0], dst.buffers[0]

    def same(start: int, ids: list[int]) -> None:
        # one NumPy assignment of exactly the blocks copy_blocks copies (its
        # core without the call): what those spans cost against one span
        n = len(ids)
        if ids == list(range(ids[0], ids[0] + n)):
            d_buf[:, ids[0] : ids[0] + n] = s_buf[:, start : start + n]
        else:
            d_buf[:, ids] = s_buf[:, start : start + n]

    rows = []
    for n in sizes:
        nbytes = n * bb
        reps = _reps(nbytes, quick)
        for pattern in K_PATTERNS:
            mine, numpy_, ratios, same_t = [], [], [], []
            for r in range(rounds):
                start = int(rng.integers(0, staging.num_blocks - n + 1))
                src = list(range(start, start + n))  # staged blocks: one run
                s0 = min(start * bb, s_flat.size - nbytes)
                work: dict[Any, list[tuple[Any, ...]]] = {ours: [], plain: [], same: []}
                for _ in range(reps):  # a fresh place in the destination each copy
                    if pattern == "consecutive":
                        first = int(rng.integers(1, n_dst - n + 1))
                        ids = list(range(first, first + n))
                    else:
                        ids = (rng.permutation(n_dst - 1)[:n] + 1).tolist()
                    work[ours].append((src, ids))
                    work[same].append((start, ids))
                    off = int(rng.integers(0, n_dst - n + 1)) * bb
                    work[plain].append((s_flat[s0 : s0 + nbytes], d_flat[off : off + nbytes]))
                order = (ours, plain, same) if r % 2 == 0 else (same, plain, ours)
                t = {f: _median_s(f, work[f]) for f in order}
                mine.append(t[ours])
                same_t.append(t[same])
                numpy_.append(t[plain])
                ratios.append(t[plain] / t[ours])
            rows.append(
                {
                    "layout": name,
                    "blocks": n,
                    "pattern": pattern,
                    "MiB": nbytes / (1 << 20),
                    "copy_blocks_GBps": nbytes / float(np.median(mine)) / 1e9,
                    "numpy_GBps": nbytes / float(np.median(numpy_)) / 1e9,
                    "copy_blocks_us": float(np.median(mine)) * 1e6,
                    "load_ratio_vs_numpy_copy": float(np.median(ratios)),
                    "load_ratio_worst": float(min(ratios)),
                    # the same blocks in one NumPy statement, against one span
                    "same_blocks_ratio_vs_numpy_copy": float(np.median(numpy_))
                    / float(np.median(same_t)),
                    "meets_target": bool(np.median(ratios) >= K_TARGET),
                    "rounds": rounds,
                    "reps": reps,
                }
            )
    return rows


# ------------------------------------------------------------ engine children
def _child() -> None:
    """One engine (``sys.argv[1]``: none | prefill | decode) driven over stdin/stdout."""
    mode, model, staging = sys.argv[1], sys.argv[2], sys.argv[3]
    from ..integrations.vllm import apply_cpu_env, cpu_engine_kwargs, run_greedy

    apply_cpu_env()
    import logging

    logging.getLogger("pddnet").setLevel(logging.ERROR)  # P's failing submits
    import vllm
    from vllm.config import KVTransferConfig

    kwargs = cpu_engine_kwargs(model, max_num_seqs=16)
    if mode == "prefill":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PrefillKVConnector",
            kv_connector_module_path="pddnet.integrations.vllm.connectors",
            kv_role="kv_producer",
            kv_connector_extra_config={"name": "p0", "secret": "pddnet-bench-vllm-secret"},
        )
    elif mode == "decode":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="DecodeKVConnector",
            kv_connector_module_path="pddnet.integrations.vllm.connectors",
            kv_role="kv_consumer",
            kv_connector_extra_config={"staging_path": staging, "staging_blocks": 1024},
        )
    engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**kwargs))
    scheduler = engine.engine_core.engine_core.scheduler
    hook_s = dict.fromkeys(K_HOOKS, 0.0)
    conn = scheduler.connector
    if conn is not None:
        for name in K_HOOKS:
            setattr(conn, name, _timed(getattr(conn, name), name, hook_s))
    steps = [0]  # engine.step() calls of the timed run
    step = engine.step

    def counted_step() -> Any:
        steps[0] += 1
        return step()

    engine.step = counted_step
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM may print: our lines go to the real stdout only
    for batch, line in enumerate(sys.stdin, 1):
        job = json.loads(line)
        rng = np.random.default_rng(job["seed"])
        prompts = {
            f"b{batch}-{i}": rng.integers(1, 500, K_PROMPT_TOKENS).tolist()
            for i in range(job["requests"])
        }
        max_tokens = int(job["max_tokens"])
        staged = K_PROMPT_TOKENS if job.get("load") else 0
        params: dict[str, Any] = {}
        for i, rid in enumerate(prompts):
            if mode == "prefill":
                params[rid] = {"pddnet": {"request_id": batch * 1000 + i, "max_tokens": 8}}
            elif mode == "decode":
                blocks = list(range(2 * i, 2 * i + 2))
                params[rid] = {"pddnet": {"blocks": blocks, "tokens": staged}}
        for k in hook_s:
            hook_s[k] = 0.0
        steps[0] = 0
        t0, c0 = time.perf_counter(), time.process_time()
        run_greedy(engine, prompts, max_tokens, kv_transfer_params=params)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        n_steps = steps[0]
        while scheduler.has_requests():  # P: failed submits free the held blocks
            engine.step()
        reply = {"elapsed_s": elapsed, "cpu_s": cpu, "steps": n_steps, "hook_s": hook_s}
        out.write("@@" + json.dumps(reply) + "\n")
        out.flush()


def _timed(fn: Callable[..., Any], name: str, acc: dict[str, float]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t0

    return wrapper


class _Engine:
    def __init__(self, mode: str, model: str, staging: str, omp: int) -> None:
        code = "from pddnet.bench.vllm import _child; _child()"
        self.mode = mode
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, mode, model, staging],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **({"OMP_NUM_THREADS": str(omp)} if omp else {})},
        )

    def run(self, requests: int, seed: int, max_tokens: int, load: bool = False) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        job = {"requests": requests, "seed": seed, "max_tokens": max_tokens, "load": load}
        self.proc.stdin.write(json.dumps(job))
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return dict(json.loads(line[2:]))
        raise RuntimeError(f"bench vllm: the {self.mode!r} engine exited {self.proc.wait()}")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def scheduler_overhead(rounds: int, requests: int, omp_threads: int = 1) -> dict[str, Any]:
    """Paired engine rounds: none, P, decoder; per-request overhead and hook times.

    Each engine runs ``omp_threads`` torch (OpenMP) threads (0: vLLM's own
    choice, one per core). With one per core, five engines' spinning OpenMP
    threads on a small shared machine make wall time measure contention: one
    engine a round ran 3 ms/request with one thread and 25 with two on 2
    loaded cores (docs/benchmarks.md)."""
    from ..integrations.vllm import build_tiny_llama

    tmp = Path(tempfile.mkdtemp(prefix="pddnet-bench-vllm-"))
    model = str(build_tiny_llama(tmp / "model"))
    engines = {m: _Engine(m, model, str(tmp / f"staging-{m}"), omp_threads) for m in K_ENGINES}
    try:
        # each connector against vLLM without one on the same requests: P's
        # finish after their first token, the decoder's run K_DECODE_TOKENS
        tokens = {"control": K_DECODE_TOKENS, "prefill": 1, "decode": K_DECODE_TOKENS}
        for m, e in engines.items():  # warm-up, untimed (also waits for the start-ups)
            e.run(requests, 1_000_000, tokens.get(m, K_DECODE_TOKENS))
        res: dict[str, list[dict[str, Any]]] = {m: [] for m in K_ENGINES}
        base: dict[str, list[dict[str, Any]]] = {m: [] for m in tokens}
        for r in range(rounds):
            for k, (m, n) in enumerate(tokens.items()):  # paired, the order alternating
                pair = ("none", m) if r % 2 == 0 else (m, "none")
                # new prompts for every pair: the no-connector engine runs in
                # each pair, and a prompt it had seen would hit its prefix cache
                seed = len(tokens) * r + k
                got = {x: engines[x].run(requests, seed, n) for x in pair}
                res[m].append(got[m])
                base[m].append(got["none"])
        loads = [  # prompts the decoder has not seen: its prefix cache misses
            engines["decode"].run(requests, 1_000_001 + r, K_DECODE_TOKENS, load=True)
            for r in range(rounds)
        ]
    finally:
        for e in engines.values():
            e.close()
    out: dict[str, Any] = {"requests": requests, "rounds": rounds, "omp_threads": omp_threads}
    for m in tokens:
        el = [x["elapsed_s"] for x in res[m]]
        none_el = [x["elapsed_s"] for x in base[m]]
        over = [(a - b) / requests * 1e6 for a, b in zip(el, none_el, strict=True)]
        cpu_over = [
            (a["cpu_s"] - b["cpu_s"]) / requests * 1e6 for a, b in zip(res[m], base[m], strict=True)
        ]
        hooks = [sum(x["hook_s"].values()) / requests * 1e6 for x in res[m]]
        out[m] = {
            "per_request_us": float(np.median(el)) / requests * 1e6,
            "none_per_request_us": float(np.median(none_el)) / requests * 1e6,
            "overhead_us_per_request": float(np.median(over)),
            "overhead_us_rounds": over,
            "overhead_us_iqr": [float(x) for x in np.percentile(over, [25, 75])],
            "overhead_fraction": float(
                np.median([(a - b) / b for a, b in zip(el, none_el, strict=True)])
            ),
            "cpu_overhead_us_per_request": float(np.median(cpu_over)),
            "cpu_overhead_us_iqr": [float(x) for x in np.percentile(cpu_over, [25, 75])],
            "steps": [x["steps"] for x in res[m]][-1],
            "none_steps": [x["steps"] for x in base[m]][-1],
            "hooks_us_per_request": float(np.median(hooks)),
            "hooks_us_worst": float(max(hooks)),
            "hooks_fraction_of_step_time": float(np.median(hooks))
            * requests
            / 1e6
            / float(np.median(el)),
            "hook_us_by_name": {
                k: float(np.median([x["hook_s"][k] for x in res[m]])) / requests * 1e6
                for k in K_HOOKS
            },
        }
    lh = [sum(x["hook_s"].values()) / requests * 1e6 for x in loads]
    out["decode_with_loads"] = {
        "hooks_us_per_request": float(np.median(lh)),
        "hooks_us_worst": float(max(lh)),
        "per_request_us": float(np.median([x["elapsed_s"] for x in loads])) / requests * 1e6,
    }
    return out


# ------------------------------------------------------------------- main
def main(args: argparse.Namespace) -> int:
    rounds = args.rounds or (5 if args.quick else 11)
    sizes = K_QUICK_SIZES if args.quick else K_SIZES
    rows: list[dict[str, Any]] = []
    for name in K_LAYOUTS:
        rows += load_rate(name, sizes[name], rounds, args.quick)
    print_table(
        [{k: v for k, v in r.items() if k not in ("rounds", "reps")} for r in rows],
        title=f"copy_blocks vs np.copyto of the same bytes ({rounds} paired rounds; target"
        f" {K_TARGET})",
    )
    summary: dict[str, Any] = {"load_target": K_TARGET}
    for r in rows:
        key = f"load_ratio_vs_numpy_copy_{r['layout']}_{r['blocks']}_{r['pattern']}"
        summary[key] = r["load_ratio_vs_numpy_copy"]
    sched: dict[str, Any] | None = None
    if not args.skip_engine:
        engine_rounds = args.engine_rounds or (15 if args.quick else 31)
        sched = scheduler_overhead(engine_rounds, args.requests, args.omp_threads)
        print_table(
            [
                {
                    "connector": m,
                    "per_request_us": sched[m]["per_request_us"],
                    "none_us": sched[m]["none_per_request_us"],
                    "overhead_us": sched[m]["overhead_us_per_request"],
                    "overhead_frac": sched[m]["overhead_fraction"],
                    "overhead_iqr_us": "{:.0f}..{:.0f}".format(*sched[m]["overhead_us_iqr"]),
                    "cpu_overhead_us": sched[m]["cpu_overhead_us_per_request"],
                    "steps": f"{sched[m]['steps']} / {sched[m]['none_steps']}",
                    "hooks_us": sched[m]["hooks_us_per_request"],
                    "hooks_frac": sched[m]["hooks_fraction_of_step_time"],
                }
                for m in ("control", "prefill", "decode")
            ],
            title=f"\nscheduler side, {args.requests} requests per round, {engine_rounds} rounds,"
            f" OMP_NUM_THREADS {args.omp_threads or 'unset'}",
        )
        print(f"decoder with real loads: hooks {sched['decode_with_loads']}")
        for m in ("control", "prefill", "decode"):
            summary[f"{m}_overhead_us_per_request"] = sched[m]["overhead_us_per_request"]
            summary[f"{m}_hooks_us_per_request"] = sched[m]["hooks_us_per_request"]
        summary["decode_hooks_us_per_request_with_loads"] = sched["decode_with_loads"][
            "hooks_us_per_request"
        ]
    write_report(args.json, summary, load_rate=rows, scheduler=sched)
    if args.png:
        _plot(rows, args.png)
    return 0


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in K_LAYOUTS:
        for pattern in K_PATTERNS:
            pts = [r for r in rows if r["layout"] == name and r["pattern"] == pattern]
            ax.plot(
                [r["blocks"] for r in pts],
                [r["load_ratio_vs_numpy_copy"] for r in pts],
                marker="o",
                label=f"{name}, {pattern}",
            )
    ax.axhline(K_TARGET, color="grey", linestyle="--", label=f"target {K_TARGET}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("blocks loaded")
    ax.set_ylabel("copy_blocks / np.copyto rate")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
