"""pddnet sim: hand-computed runs of a tiny cluster, determinism, the config's errors."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from pddnet.route import Route
from pddnet.sim import (
    SimConfig,
    SimConfigError,
    Simulation,
    Turn,
    Workload,
    load_config,
    run_metrics,
    run_pair,
    session_tokens,
)
from pddnet.sim._cli import main as cli_main

# A GPU and model chosen so that every time below is plain arithmetic:
#   weights 1e8 params x 2 B = 2e8 B; HBM 1e11 B/s at mbu 1 -> 2 ms a pass;
#   KV per token 2 x 1 layer x 1 head x 64 x 2 B = 256 B -> 2.56e-9 s per token read;
#   dense FLOPs 2 x 1e8 = 2e8 per token at 1e12 FLOP/s -> 0.2 ms per token;
#   attention 4 x 1 layer x 64 = 256 FLOPs per token per context token -> 2.56e-10 s.
# No pass overhead. The WAN: 8e8 b/s = 1e8 B/s, RTT 0.1 s (0.05 s each way), no
# jitter or loss, one stream, chunks large enough for a whole transfer.
# Blocks of 16 tokens x 256 B = 4096 B.
GPU = {"hbm_bytes_s": 1e11, "flops": 1e12, "memory_bytes": 1e9, "price_per_hour": 1.0}
TINY: dict[str, Any] = {
    "model": {
        "params": 1e8,
        "layers": 1,
        "kv_heads": 1,
        "head_dim": 64,
        "attn_width": 64,
        "dtype_bytes": 2,
    },
    "gpu": {"A": {"name": "a", **GPU}, "B": {"name": "b", **GPU}},
    "engine": {"mfu": 1.0, "mbu": 1.0, "pass_overhead_s": 0.0, "memory_reserve": 1.0},
    "cluster": {
        "prefill": 1,
        "relay": 1,
        "main": 1,
        "kv_block_tokens": 16,
        "local_bandwidth_bytes_s": 1e10,
        "local_rtt_s": 0.0,
    },
    "wan": {
        "bandwidth_bps": 8e8,
        "rtt_s": 0.1,
        "jitter_s": 0.0,
        "loss": 0.0,
        "streams": 1,
        "chunk_bytes": 1 << 20,
        "min_chunk_bytes": 1 << 20,
    },
    "workload": {"system_prompt_tokens": 0},
}

# Prefill of the 1024-token prompt, nothing cached: compute 1024 x 0.2 ms =
# 0.2048 s plus attention 1024 x (0 + 512) x 2.56e-10 = 1.34217728e-4 s
# (memory: 2 ms + 1024 x 2.56e-9, smaller).
PREFILL = 0.2048 + 1.34217728e-4
# Its KV: 64 blocks x 4096 B = 262144 B; on the WAN 262144 / 1e8 = 2.62144e-3 s.
WAN_BYTES = 262144
SERIALISE = 2.62144e-3


def _cfg(**over: dict[str, object]) -> SimConfig:
    sections: dict[str, Any] = {k: dict(v) for k, v in TINY.items()}
    for key, values in over.items():
        sections[key] = {**sections.get(key, {}), **values}
    return load_config(**sections)


def one_request(output: int) -> Workload:
    return Workload([[Turn(0, 0, 1024, 0, output, 0.0)]], system_prompt=0)


def test_one_request_p_md_matches_hand_computation() -> None:
    cfg = _cfg()
    (r,) = Simulation(cfg, one_request(5), baseline=True).run().requests
    assert r.route == Route.P_MD.value and r.failure is None
    # P ends the prefill at PREFILL; the offer reaches MD 0.05 s later and its
    # accept comes back 0.05 s after that, when the transfer starts; the one
    # chunk leaves in SERIALISE and lands 0.05 s later. MD owns the request at
    # once (P->MD) and emits P's first token.
    first = PREFILL + 0.1 + SERIALISE + 0.05
    assert r.ttft == pytest.approx(first, rel=1e-12)
    assert r.wan_bytes == WAN_BYTES
    # Then 4 decode steps (tokens 1..4) at batch 1, context 1025, 1026, 1027, 1028:
    # each 2 ms of weights + ctx x 2.56e-9 (memory-bound: compute is 0.2 ms):
    # 4 x 0.002 + 2.56e-9 x (1025 + 1026 + 1027 + 1028) = 0.008 + 1.051136e-5.
    assert r.finished == pytest.approx(first + 0.008 + 1.051136e-5, rel=1e-12)
    assert (r.rld_tokens, r.md_tokens) == (0, 5)


def test_one_request_relayed_one_shot_matches_hand_computation() -> None:
    # A TTFT target below the WAN's RTT: the router masks the transfer with RLD.
    cfg = _cfg(router={"ttft_target_s": 0.01}, handoff={"mode": "one-shot"})
    sim = Simulation(cfg, one_request(200))
    (r,) = sim.run().requests
    assert r.route == Route.P_RLD_MD.value and r.failure is None
    # RLD's KV: 262144 B over the local path at 1e10 B/s = 2.62144e-5 s; RLD
    # emits P's first token then.
    local = 2.62144e-5
    assert r.ttft == pytest.approx(PREFILL + local, rel=1e-12)
    # MD's KV lands at PREFILL + 0.15262144 (as on P->MD); its KvReady reaches
    # RLD 0.05 s later, 0.2025952256 s after RLD's first token. RLD's steps
    # (batch 1, context 1025 + i) take 0.002 + (1025 + i) x 2.56e-9 each:
    # 101 steps take 0.202 + 2.56e-9 x 108575 = 0.202277952 s (in time),
    # 102 take 0.204 + 2.56e-9 x 109701 = 0.20428083456 s (too late).
    # So RLD holds tokens 0..101 (102) and sends them all (one-shot).
    assert r.rld_tokens == 102
    # They reach MD 0.05 s later; MD recomputes them in one extend pass of
    # 102 tokens after 1024: compute 102 x 0.2 ms = 0.0204 s plus attention
    # 102 x (1024 + 51) x 2.56e-10 = 2.80704e-5 s (memory, 2 ms, is smaller).
    kv_ready_at_rld = PREFILL + 0.1 + SERIALISE + 0.05 + 0.05
    takeover = kv_ready_at_rld + 0.05 + 0.0204 + 2.80704e-5
    # MD emits token 102 at once: the stall since RLD's token 101.
    rld_last = PREFILL + local + 0.202277952
    assert r.handoff_stall_s == pytest.approx(takeover - rld_last, rel=1e-9)
    # Then 97 steps (tokens 103..199) from context 1127:
    # 97 x 0.002 + 2.56e-9 x (97 x 1127 + 97 x 96 / 2) = 0.194 + 2.56e-9 x 113975.
    assert r.finished == pytest.approx(takeover + 0.194 + 2.56e-9 * 113975, rel=1e-9)
    assert (r.rld_tokens, r.md_tokens) == (102, 98)
    # RLD let go: the router's slot is back.
    assert sim.routers[0].active_relays == 0


def test_same_seed_same_results_other_seed_differs() -> None:
    cfg = load_config(workload={"sessions": 40, "seed": 3})
    a = run_pair(cfg, Workload.generate(cfg.workload))  # two processes (jobs=2)
    b = run_pair(cfg, Workload.generate(cfg.workload), jobs=1)  # one after the other
    for mode in ("baseline", "pdd"):
        # as JSON: a nan (no handoff's stall) equals itself there
        assert json.dumps(a[mode], sort_keys=True) == json.dumps(b[mode], sort_keys=True)
    c = load_config(workload={"sessions": 40, "seed": 4})
    other = run_pair(c, Workload.generate(c.workload))
    assert other["pdd"]["ttft_p50_s"] != a["pdd"]["ttft_p50_s"]


def test_generated_workload_is_skewed_and_prompts_share_prefixes() -> None:
    cfg = load_config()
    w = Workload.generate(cfg.workload, 300)
    # most turns hit above 95%, the mean is pulled down by a few low-hit turns
    assert w.share_above(0.95) > 0.6
    assert 0.7 < w.mean_hit() < 0.95
    s = w.sessions[0]
    assert all(b.cached == a.prompt for a, b in itertools.pairwise(s))
    t0 = session_tokens(0, 3000, 2048)
    t1 = session_tokens(1, 3000, 2048)
    assert (t0[:2048] == t1[:2048]).all() and not (t0[2048:] == t1[2048:]).any()


def test_baseline_never_uses_rld_and_costs_what_its_gpus_cost() -> None:
    cfg = load_config(workload={"sessions": 30})
    w = Workload.generate(cfg.workload)
    base = run_metrics(Simulation(cfg, w, baseline=True).run(), cfg)
    assert base["rld_token_share"] == 0.0
    # default: 35 + 8 H200 at 3.5 $/h and 32 H20 at 1.5 $/h
    assert base["cost_per_hour"] == pytest.approx(43 * 3.5 + 32 * 1.5)
    assert base["gpus"] == {"prefill": 43, "relay": 0, "main": 32}


@pytest.mark.parametrize(
    ("over", "key"),
    [
        ({"wan": {"bandwidth_gbps": 1.0}}, "wan.bandwidth_gbps"),
        ({"wan": {"rtt_s": "fast"}}, "wan.rtt_s"),
        ({"engine": {"mfu": 1.5}}, "engine.mfu"),
        ({"cluster": {"main_gpu": "C"}}, "cluster.main_gpu"),
        ({"handoff": {"mode": "twice"}}, "handoff.mode"),
        ({"nonsense": {}}, "nonsense"),
    ],
)
def test_bad_config_names_the_key(over: dict[str, Any], key: str) -> None:
    with pytest.raises(SimConfigError) as info:
        load_config(**over)
    assert info.value.key == key


def test_config_file_and_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        json.dumps({"session": "a", "arrival_s": 0.5, "prompt_tokens": 3000, "output_tokens": 7})
        + "\n"
        + json.dumps({"session": "a", "think_s": 1.0, "prompt_tokens": 3100, "output_tokens": 9})
        + "\n"
    )
    conf = tmp_path / "c.toml"
    conf.write_text(f'[workload]\ntrace = "{trace}"\n')
    cfg = load_config(conf)
    from pddnet.sim import workload_for

    w = workload_for(cfg)
    (s,) = w.sessions
    assert [(t.prompt, t.cached, t.output) for t in s] == [(3000, 2048, 7), (3100, 3000, 9)]
    bad = tmp_path / "bad.toml"
    bad.write_text("[wan]\nstreams = 0\n")
    with pytest.raises(SimConfigError) as info:
        load_config(bad)
    assert info.value.key == "wan.streams"


def test_cli_quick_json_has_the_summary(tmp_path: Path) -> None:
    import argparse

    from pddnet.sim._cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "s.json"
    args = p.parse_args(["--sessions", "20", "--json", str(out)])
    assert cli_main(args) == 0
    s = json.loads(out.read_text())["summary"]
    for key in (
        "ttft_p50_reduction",
        "ttft_p99_reduction",
        "goodput_gain",
        "bcr_gain",
        "rld_token_share",
        "requests_simulated",
        "sim_requests_per_s",
    ):
        assert key in s
    assert s["requests_simulated"] > 20


@pytest.mark.parametrize(("mode", "catch_up"), [("one-shot", False), ("catch-up", True)])
def test_relayed_tokens_add_up_and_catch_up_takes_rounds(mode: str, catch_up: bool) -> None:
    # A slow link (1e6 B/s: the KV lands after ~0.26 s, ~130 tokens) with a short
    # RTT (10 ms), so that catch-up converges: RLD decodes ~500 tokens/s, MD
    # recomputes ~4900 tokens/s, and 500 x (130 / 4900 + 0.01) < 16 tokens.
    cfg = _cfg(
        router={"ttft_target_s": 0.01},
        handoff={"mode": mode},
        wan={"bandwidth_bps": 8e6, "rtt_s": 0.01},
    )
    sim = Simulation(cfg, one_request(400))
    (r,) = sim.run().requests
    assert r.route == Route.P_RLD_MD.value and r.failure is None
    # every token once: RLD's, then MD's from the switch on
    assert r.rld_tokens + r.md_tokens == 400
    # more than catchup_threshold (64) tokens pending when MD's KV lands:
    # catch-up hands over in rounds while RLD keeps decoding; one-shot in one
    assert (r.rounds > 1) if catch_up else (r.rounds == 1)
    assert sim.routers[0].active_relays == 0


@pytest.mark.parametrize("admission", [True, False])
def test_admission_sheds_when_rld_is_full(admission: bool) -> None:
    # Ten requests at once; P prefills one every ~0.205 s; each relay lasts
    # past the next one's prefill (~0.2 s to MD's KvReady plus the handoff),
    # so with one relay slot every other request finds RLD full.
    cfg = _cfg(
        router={"ttft_target_s": 0.01, "max_concurrent_relays": 1, "admission": admission},
    )
    turns = [[Turn(s, 0, 1024, 0, 200, 0.0)] for s in range(10)]
    run = Simulation(cfg, Workload(turns, system_prompt=0)).run()
    reasons = run.router["by_reason"]
    if admission:
        assert reasons.get("RELAY_FULL", 0) > 0
        assert reasons["RELAY_FULL"] + reasons["MASK_TRANSFER"] == 10
    else:
        assert reasons == {"MASK_TRANSFER": 10}
    assert all(r.failure is None for r in run.requests)


def test_wan_stream_cap_is_window_over_rtt_then_mathis() -> None:
    from pddnet.sim import WanModel

    cfg = load_config()
    # 32 MiB window over 30 ms: 33554432 / 0.03 = 1118481066.7 B/s per stream
    w = WanModel(cfg.wan)
    assert w.stream_cap_bytes_s == pytest.approx(1118481066.7)
    # 100 Gb/s shared by 200 sending streams: 12.5e9 / 200 = 62.5e6 B/s each
    assert w.stream_rate(200) == pytest.approx(62.5e6)
    # loss 1e-4: Mathis, 1448 B / 0.03 s = 48266.67 B/s, x sqrt(3/2) = 1.2247449
    # -> 59114.35, / sqrt(1e-4) = 0.01 -> 5911435 B/s
    lossy = WanModel(load_config(wan={"loss": 1e-4}).wan)
    assert lossy.stream_cap_bytes_s == pytest.approx(5911435, rel=1e-6)
    assert lossy.goodput_bytes_s == pytest.approx(12.5e9 * (1 - 1e-4))


@pytest.mark.parametrize(("batch", "ctx"), [(32, 32 * 30000), (1, 100), (64, 64 * 8)])
def test_decode_segments_sum_their_steps(batch: int, ctx: int) -> None:
    from pddnet.sim import EngineModel

    cfg = load_config()
    for gpu in cfg.gpu.values():
        m = EngineModel(cfg.model, gpu, cfg.engine)
        steps = [m.decode_step_s(batch, ctx + i * batch) for i in range(50)]
        assert m.decode_steps_s(batch, ctx, 50) == pytest.approx(sum(steps), rel=1e-12)


def test_sink_at_p_adds_mds_one_way_delay_to_ttft() -> None:
    # PrefillEndpoint's token sink on P: MD's first token crosses the WAN back (0.05 s).
    cfg = _cfg(cluster={"sink": "prefill"})
    (r,) = Simulation(cfg, one_request(5), baseline=True).run().requests
    assert r.ttft == pytest.approx(PREFILL + 0.1 + SERIALISE + 0.05 + 0.05, rel=1e-12)


def test_slow_start_after_idle_costs_round_trips_by_hand() -> None:
    # A fresh stream starts from 10 x 1448 = 14,480 B and doubles each RTT
    # (0.1 s) until the window covers 1e8 B/s x 0.1 s: 14480 + 28960 + 57920 +
    # 115840 = 217,200 B in 4 RTTs, the other 44,944 B at the link's rate.
    cfg = _cfg(wan={"slow_start_after_idle": True})
    (r,) = Simulation(cfg, one_request(5), baseline=True).run().requests
    send = 0.4 + 44944 / 1e8
    assert r.ttft == pytest.approx(PREFILL + 0.1 + send + 0.05, rel=1e-12)
    wan = Simulation(cfg, one_request(5)).wan
    assert wan.send_s(35000, 1e6, idle_s=0.2) == pytest.approx(0.035)  # within the RTO
    assert wan.rto_s == pytest.approx(0.3)


@pytest.mark.parametrize("keep", [False, True])
def test_keep_strange_traffic_feeds_mds_cache_when_rld_finishes_first(keep: bool) -> None:
    # RLD answers 3 tokens long before the KV lands on MD (0.1 s of offer
    # round trip first): strange traffic. Cancelled, MD caches nothing; kept
    # (the demo's RelayEndpoint(cut_off_wan=False) + keep_strange_traffic),
    # the transfer lands and MD caches the prompt's 64 blocks.
    cfg = _cfg(router={"ttft_target_s": 0.01}, handoff={"keep_strange_traffic": keep})
    sim = Simulation(cfg, one_request(3))
    (r,) = sim.run().requests
    assert r.route == Route.P_RLD_MD.value and r.failure is None
    assert (r.rld_tokens, r.md_tokens) == (3, 0)
    assert len(sim.servers[0].cache) == (64 if keep else 0)
    assert sim.free_blocks[0].__len__() + len(sim.servers[0].cache) == len(
        Simulation(cfg, one_request(3)).free_blocks[0]
    )
