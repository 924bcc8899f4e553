#!/usr/bin/env python3
"""GPU check of the recompute kernels (one H200, under 8 minutes).

Run from the repository root on a machine with CuPy and a CUDA device::

    python3 bench/gpu_check.py                 # docs/kernels_gpu.{json,md}, docs/kernels.md
    python3 bench/gpu_check.py --out-dir DIR   # also copies both results into DIR
    python3 bench/gpu_check.py --quick         # a subset, about a minute

It measures, in one process:

1. correctness against the NumPy reference on fresh random inputs, in fp32,
   fp16 and bf16 KV: every kernel (outputs poisoned with NaN first, so an
   unwritten element fails), and the model's extend against its own decode
   steps on the GPU (KV max relative error, next greedy token);
2. a device-to-device copy ceiling (GB/s counting bytes read + written);
3. extend-attention time on a 7B-like layer shape (32 query / 8 KV heads of
   128, Mistral-7B) for n in {1, 16, 64, 128, 256} new tokens over prefixes of
   4K-64K tokens, with L2 flushed before each timed run, and the KV bytes read
   per second as a fraction of the copy ceiling;
4. the whole one-layer extend (norms, GEMMs via cuBLAS, RoPE, KV write,
   attention, LM head) for the same n.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from pddnet.kv import KVPool  # noqa: E402
from pddnet.recompute import (  # noqa: E402
    MISTRAL_7B_LIKE,
    TINY,
    LayerWeights,
    ModelConfig,
    PagedSequence,
    ReferenceModel,
    Weights,
    greedy,
    kernels_for,
)
from pddnet.recompute import _reference as ref  # noqa: E402

K_DEADLINE_S = 7 * 60  # stop starting new measurements after this
K_DTYPES = ("float16", "bfloat16")
K_NS = (1, 16, 64, 128, 256)
K_PREFIXES = (4096, 16384, 32768, 65536)
K_BLOCK = 16
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def out_of_time() -> bool:
    return time.monotonic() - T0 > K_DEADLINE_S


def to_f32(a: Any) -> Any:
    return ref.bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32)


def from_f32(a: Any, dtype: str) -> Any:
    return ref.f32_to_bf16(a) if dtype == "bfloat16" else a.astype(dtype)


# ----------------------------------------------------------------- correctness
def check_kernels(cp: Any, rng: Any) -> list[dict[str, Any]]:
    gpu = kernels_for(cp)
    rows = []
    for dtype in ("float32", "float16", "bfloat16"):
        for n, start, heads, kvh, d in [
            (1, 4095, 32, 8, 128),
            (16, 4000, 32, 8, 128),
            (128, 2048, 32, 8, 128),
            (7, 45, 8, 2, 64),
            (100, 13, 4, 2, 16),
        ]:
            length = start + n
            nb = -(-length // K_BLOCK) + 5
            buf = from_f32(rng.standard_normal((nb, 2, K_BLOCK, kvh, d), dtype=np.float32), dtype)
            table = rng.permutation(nb)[: -(-length // K_BLOCK)].astype(np.int32)
            q = rng.standard_normal((n, heads, d), dtype=np.float32)
            # kv write of the new tokens: bit-identical to NumPy's, nothing else touched
            k_new = rng.standard_normal((n, kvh, d), dtype=np.float32)
            v_new = rng.standard_normal((n, kvh, d), dtype=np.float32)
            dbuf = cp.asarray(buf)
            ref.kv_write(buf[:, 0], buf[:, 1], table, start, k_new, v_new)
            gpu.kv_write(
                dbuf[:, 0],
                dbuf[:, 1],
                cp.asarray(table),
                start,
                cp.asarray(k_new),
                cp.asarray(v_new),
            )
            kv_ok = bool(np.array_equal(cp.asnumpy(dbuf).view(np.uint8), buf.view(np.uint8)))
            out = cp.empty((n, heads, d), np.float32)
            out.view(cp.uint8).fill(0xFF)
            gpu.extend_attention(
                cp.asarray(q), dbuf[:, 0], dbuf[:, 1], cp.asarray(table), start, d**-0.5, out=out
            )
            got = cp.asnumpy(out)
            want = ref.extend_attention(q, buf[:, 0], buf[:, 1], table, start, d**-0.5)
            written = bool(np.isfinite(got).all())
            err = float(np.abs(got - want).max() / np.abs(want).max()) if written else math.inf
            rows.append(
                {
                    "kernel": "kv_write+extend_attention",
                    "dtype": dtype,
                    "n": n,
                    "prefix": start,
                    "heads": f"{heads}/{kvh}x{d}",
                    "kv_write_bit_exact": kv_ok,
                    "all_written": written,
                    "max_rel_err": err,
                    "ok": kv_ok and written and err <= 1e-4,
                }
            )
    x = rng.standard_normal((33, 8, 128), dtype=np.float32)
    dx = cp.asarray(x)
    ref.rope_(x, 65000, 1e6)
    gpu.rope_(dx, 65000, 1e6)
    err = float(np.abs(cp.asnumpy(dx) - x).max() / np.abs(x).max())
    rows.append({"kernel": "rope", "dtype": "float32", "max_rel_err": err, "ok": err <= 1e-5})
    h = rng.standard_normal((5, 4096), dtype=np.float32)
    w = rng.standard_normal(4096, dtype=np.float32)
    out = cp.empty(h.shape, np.float32)
    out.view(cp.uint8).fill(0xFF)
    gpu.rms_norm(cp.asarray(h), cp.asarray(w), 1e-5, out=out)
    got = cp.asnumpy(out)
    want = ref.rms_norm(h, w, 1e-5)
    err = (
        float(np.abs(got - want).max() / np.abs(want).max()) if np.isfinite(got).all() else math.inf
    )
    rows.append({"kernel": "rms_norm", "dtype": "float32", "max_rel_err": err, "ok": err <= 1e-5})
    return rows


def gpu_model(cp: Any, cfg: ModelConfig, weights: Weights, dtype: str, blocks: int) -> Any:
    layout = cfg.kv_layout(K_BLOCK, dtype)
    bufs = [cp.zeros(layout.buffer_shape(blocks), layout.np_dtype) for _ in range(cfg.num_layers)]
    matrix = "float32" if dtype == "float32" else "float16"
    return ReferenceModel(cfg, weights, KVPool(layout, bufs), matrix_dtype=matrix)


def check_model(cp: Any) -> list[dict[str, Any]]:
    small = ModelConfig(1000, 256, 2, 8, 2, 64, 512)
    rows = []
    for cfg_name, cfg in (("tiny", TINY), ("small", small)):
        weights = Weights.random(cfg, 1)
        for dtype in ("float32", "float16", "bfloat16"):
            for prefix, n in ((13, 1), (45, 7), (32, 64), (29, 100)):
                blocks = 16
                rld = gpu_model(cp, cfg, weights, dtype, blocks)
                md = gpu_model(cp, cfg, weights, dtype, blocks)
                rng = np.random.default_rng(prefix * n)
                t_rld = rng.permutation(blocks).astype(np.int32)
                t_md = rng.permutation(blocks).astype(np.int32)
                rs, ms = PagedSequence(t_rld), PagedSequence(t_md)
                token = greedy(rld.prefill(rs, rng.integers(0, cfg.vocab_size, prefix)))
                nb = -(-prefix // K_BLOCK)
                for a, b in zip(rld.pool.buffers, md.pool.buffers, strict=True):
                    b[cp.asarray(t_md[:nb])] = a[cp.asarray(t_rld[:nb])]
                ms.length = prefix
                eager = []
                for _ in range(n):
                    eager.append(token)
                    token = greedy(rld.decode_step(rs, token))
                match = greedy(md.extend(ms, eager)) == token
                pos = np.arange(prefix, prefix + n)
                err = 0.0
                for a, b in zip(rld.pool.buffers, md.pool.buffers, strict=True):
                    want = to_f32(cp.asnumpy(a)[t_rld[pos // K_BLOCK], :, pos % K_BLOCK])
                    got = to_f32(cp.asnumpy(b)[t_md[pos // K_BLOCK], :, pos % K_BLOCK])
                    err = max(err, float(np.abs(got - want).max() / np.abs(want).max()))
                tol = 1e-5 if dtype == "float32" else 2e-2
                rows.append(
                    {
                        "model": cfg_name,
                        "dtype": dtype,
                        "prefix": prefix,
                        "n": n,
                        "kv_max_rel_err": err,
                        "greedy_match": match,
                        "ok": match and err <= tol,
                    }
                )
    # GPU fp32 model vs the NumPy model
    weights = Weights.random(small, 2)
    g = gpu_model(cp, small, weights, "float32", 16)
    c = ReferenceModel.create(small, 16, weights=weights)
    gs, cs = PagedSequence(np.arange(16, dtype=np.int32)), c.new_sequence()
    lg, lc = cp.asnumpy(g.prefill(gs, list(range(100, 140)))), c.prefill(cs, list(range(100, 140)))
    err = float(np.abs(lg - lc).max() / np.abs(lc).max())
    same = g.generate(gs, greedy(lc), 10) == c.generate(cs, greedy(lc), 10)
    rows.append(
        {
            "model": "small gpu-vs-numpy",
            "dtype": "float32",
            "logits_rel_err": err,
            "greedy_match": same,
            "ok": same and err <= 1e-3,
        }
    )
    return rows


# --------------------------------------------------------------------- timing
class Timer:
    def __init__(self, cp: Any) -> None:
        self.cp = cp
        # larger than L2 (60 MB on an H200): rewritten before each timed run
        self.flush = cp.empty(256 << 20, cp.uint8)
        self.start, self.end = cp.cuda.Event(), cp.cuda.Event()

    def __call__(self, fn: Any, reps: int, *, flush: bool = True) -> float:
        fn()  # warm-up (and compile)
        self.cp.cuda.Device().synchronize()
        times = []
        for _ in range(reps):
            if flush:
                self.flush.fill(1)
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            times.append(self.cp.cuda.get_elapsed_time(self.start, self.end) / 1e3)
        return float(np.median(times))


def copy_ceiling(cp: Any, timer: Timer) -> dict[str, float]:
    nbytes = 2 << 30
    src = cp.ones(nbytes, cp.uint8)
    dst = cp.empty_like(src)
    t_memcpy = timer(lambda: dst.data.copy_from_device_async(src.data, nbytes), 20, flush=False)
    t_kernel = timer(lambda: cp.copyto(dst, src), 20, flush=False)
    bw = {
        "memcpy_GBps": 2 * nbytes / t_memcpy / 1e9,
        "copy_kernel_GBps": 2 * nbytes / t_kernel / 1e9,
    }
    bw["ceiling_GBps"] = max(bw.values())
    return bw


def attention_timings(cp: Any, timer: Timer, ceiling: float, quick: bool) -> list[dict[str, Any]]:
    gpu = kernels_for(cp)
    c = MISTRAL_7B_LIKE
    rows: list[dict[str, Any]] = []
    prefixes = (4096, 65536) if quick else K_PREFIXES
    for dtype in K_DTYPES:
        max_len = max(prefixes) + max(K_NS)
        nb = -(-max_len // K_BLOCK)
        buf = cp.random.standard_normal((nb, 2, K_BLOCK, c.num_kv_heads, c.head_dim), np.float32)
        if dtype == "bfloat16":
            buf = (buf.view(cp.uint32) >> 16).astype(cp.uint16)  # truncation is fine for timing
        else:
            buf = buf.astype(cp.float16)
        table = cp.asarray(np.random.default_rng(0).permutation(nb).astype(np.int32))
        for prefix in prefixes:
            for n in K_NS:
                if out_of_time():
                    rows.append({"dtype": dtype, "prefix": prefix, "n": n, "skipped": "deadline"})
                    continue
                q = cp.random.standard_normal((n, c.num_heads, c.head_dim), np.float32)
                out = cp.empty_like(q)

                def run(
                    q: Any = q,
                    out: Any = out,
                    prefix: int = prefix,
                    buf: Any = buf,
                    table: Any = table,
                ) -> None:
                    gpu.extend_attention(
                        q, buf[:, 0], buf[:, 1], table, prefix, c.head_dim**-0.5, out=out
                    )

                t = timer(run, 10)
                kv_bytes = (prefix + n) * 2 * c.num_kv_heads * c.head_dim * 2
                bw = kv_bytes / t / 1e9
                flops = 4 * (prefix + n) * n * c.num_heads * c.head_dim
                rows.append(
                    {
                        "dtype": dtype,
                        "prefix": prefix,
                        "n": n,
                        "attn_us": t * 1e6,
                        "kv_GBps": bw,
                        "frac_of_copy": bw / ceiling,
                        "TFLOPs": flops / t / 1e12,
                    }
                )
                log(f"attention {dtype} prefix={prefix} n={n}: {t * 1e6:.1f} us, {bw:.0f} GB/s")
    return rows


def layer_timings(cp: Any, timer: Timer, quick: bool) -> list[dict[str, Any]]:
    c = MISTRAL_7B_LIKE.with_layers(1)
    rs = cp.random.RandomState(0)

    def mat(a: int, b: int) -> Any:
        return (rs.standard_normal((a, b), dtype=np.float32) / np.float32(math.sqrt(a))).astype(
            np.float16
        )

    ones = cp.ones(c.hidden, np.float32)
    layer = LayerWeights(
        ones,
        mat(c.hidden, c.qkv_width),
        mat(c.num_heads * c.head_dim, c.hidden),
        ones,
        mat(c.hidden, 2 * c.intermediate),
        mat(c.intermediate, c.hidden),
    )
    embed = rs.standard_normal((c.vocab_size, c.hidden), dtype=np.float32)
    weights = Weights(c, embed, [layer], ones, mat(c.hidden, c.vocab_size))
    rows: list[dict[str, Any]] = []
    prefixes = (16384,) if quick else (4096, 16384, 65536)
    for dtype in K_DTYPES:
        max_len = max(prefixes) + max(K_NS)
        nb = -(-max_len // K_BLOCK)
        model = gpu_model(cp, c, weights, dtype, nb)
        table = np.random.default_rng(1).permutation(nb).astype(np.int32)
        for prefix in prefixes:
            for n in K_NS:
                if out_of_time():
                    rows.append({"dtype": dtype, "prefix": prefix, "n": n, "skipped": "deadline"})
                    continue
                seq = PagedSequence(table, prefix)
                tokens = list(range(1, n + 1))

                def run(
                    seq: PagedSequence = seq,
                    prefix: int = prefix,
                    tokens: Any = tokens,
                    model: Any = model,
                ) -> None:
                    seq.length = prefix
                    model.extend(seq, tokens)

                t = timer(run, 5)
                rows.append(
                    {
                        "dtype": dtype,
                        "prefix": prefix,
                        "n": n,
                        "layer_extend_us": t * 1e6,
                        "us_per_token": t * 1e6 / n,
                    }
                )
                log(f"layer extend {dtype} prefix={prefix} n={n}: {t * 1e6:.1f} us")
    return rows


# ------------------------------------------------------------------- reporting
def markdown(report: dict[str, Any]) -> str:
    def table(rows: list[dict[str, Any]]) -> list[str]:
        rows = [r for r in rows if "skipped" not in r]
        if not rows:
            return ["(none)"]
        cols = list(dict.fromkeys(k for r in rows for k in r))
        out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            cells = []
            for k in cols:
                v = r.get(k, "")
                cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
            out.append("| " + " | ".join(cells) + " |")
        return out

    env = report["environment"]
    lines = [
        f"Run {env['time']} on {env['device']} (CuPy {env['cupy']}, CUDA runtime"
        f" {env['cuda_runtime']}), `{env['command']}`, {report['elapsed_s']:.0f} s.",
        "",
        f"All correctness checks passed: **{report['all_ok']}**.",
        "",
        "Copy ceiling (device-to-device, bytes read + written): "
        f"{report['copy']['ceiling_GBps']:.0f} GB/s"
        f" (cudaMemcpy {report['copy']['memcpy_GBps']:.0f}, copy kernel"
        f" {report['copy']['copy_kernel_GBps']:.0f}).",
        "",
        "Extend attention, 32 query / 8 KV heads of 128 (KV bytes read per second):",
        "",
        *table(report["attention"]),
        "",
        "One-layer extend (norms, cuBLAS GEMMs, RoPE, KV write, attention, LM head):",
        "",
        *table(report["layer"]),
        "",
        "Kernel correctness against NumPy:",
        "",
        *table(report["kernels"]),
        "",
        "Model: extend vs decode on the GPU:",
        "",
        *table(report["model"]),
    ]
    return "\n".join(lines)


def update_docs(md: str, path: Path) -> None:
    begin, end = "<!-- gpu-results:begin -->", "<!-- gpu-results:end -->"
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{md}\n{end}"
    if begin in text and end in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text += f"\n## GPU results\n\n{block}\n"
    path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a subset (about a minute)")
    parser.add_argument("--out-dir", type=Path, help="also copy the results here")
    parser.add_argument("--no-docs", action="store_true", help="leave docs/ alone")
    args = parser.parse_args()
    import cupy as cp

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    log(f"device {name}, {dev.attributes['MultiProcessorCount']} SMs, CuPy {cp.__version__}")
    rng = np.random.default_rng(12345)
    report: dict[str, Any] = {
        "environment": {
            "device": name,
            "sms": dev.attributes["MultiProcessorCount"],
            "cupy": cp.__version__,
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "python3 bench/gpu_check.py" + (" --quick" if args.quick else ""),
        }
    }
    report["kernels"] = check_kernels(cp, rng)
    log(f"kernel checks: {sum(r['ok'] for r in report['kernels'])}/{len(report['kernels'])} ok")
    report["model"] = check_model(cp)
    log(f"model checks: {sum(r['ok'] for r in report['model'])}/{len(report['model'])} ok")
    timer = Timer(cp)
    report["copy"] = copy_ceiling(cp, timer)
    log(f"copy ceiling {report['copy']}")
    report["attention"] = attention_timings(cp, timer, report["copy"]["ceiling_GBps"], args.quick)
    report["layer"] = layer_timings(cp, timer, args.quick)
    report["all_ok"] = all(r["ok"] for r in report["kernels"] + report["model"])
    long = [r for r in report["attention"] if "skipped" not in r and r["prefix"] >= 16384]
    report["target"] = {
        "attention_frac_of_copy_min_prefix_ge_16k": min(
            (r["frac_of_copy"] for r in long), default=None
        ),
        "by_n": {
            str(n): min((r["frac_of_copy"] for r in long if r["n"] == n), default=None)
            for n in K_NS
        },
    }
    report["elapsed_s"] = time.monotonic() - T0
    md = markdown(report)
    print(md)
    docs = ROOT / "docs"
    (docs / "kernels_gpu.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (docs / "kernels_gpu.md").write_text(md + "\n")
    if not args.no_docs:
        update_docs(md, docs / "kernels.md")
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for f in ("kernels_gpu.json", "kernels_gpu.md", "kernels.md"):
            if (docs / f).exists():
                shutil.copy(docs / f, args.out_dir / f)
    log("done")
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
