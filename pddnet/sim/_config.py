"""The simulator's configuration: typed sections loaded from TOML.

``default.toml`` (next to this module) holds every key with its default; a
user's file overrides keys section by section. A key the defaults do not
have, a value of the wrong type or out of range is a :class:`SimConfigError`
that names the key. docs/sim.md states where each default comes from.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import PddnetError

__all__ = [
    "ClusterConfig",
    "EngineConfig",
    "GpuConfig",
    "HandoffConfig",
    "ModelConfig",
    "RouterConfig",
    "SimConfig",
    "SimConfigError",
    "SlaConfig",
    "WanConfig",
    "WorkloadConfig",
    "load_config",
]

K_DEFAULT_PATH = Path(__file__).with_name("default.toml")


class SimConfigError(PddnetError):
    """A simulator configuration is invalid; ``key`` names the offending entry."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The served model's size (what memory-bound decode and KV bytes depend on)."""

    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    attn_width: int
    dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class GpuConfig:
    """One GPU type: datasheet peaks and a price.

    ``pace_s`` and ``per_request_s`` (both 0 unless given) describe an engine
    that is not a GPU's roofline: ``pace_s`` is a sleep before every forward
    pass (the demo's paced reference engine), ``per_request_s`` a fixed cost
    per request in a pass (an engine that runs each request's pass in turn).
    """

    name: str
    hbm_bytes_s: float
    flops: float
    memory_bytes: float
    price_per_hour: float
    pace_s: float = 0.0
    per_request_s: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    mfu: float
    mbu: float
    pass_overhead_s: float
    md_max_batch: int
    rld_max_batch: int
    batch_tails: bool
    memory_reserve: float


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    prefill: int
    prefill_gpu: str
    relay: int
    relay_gpu: str
    main: int
    main_gpu: str
    kv_block_tokens: int
    local_bandwidth_bytes_s: float
    local_rtt_s: float
    baseline_relay_as: str
    sink: str = "decoder"


@dataclass(frozen=True, slots=True)
class WanConfig:
    bandwidth_bps: float
    rtt_s: float
    jitter_s: float
    loss: float
    mss_bytes: int
    window_bytes: int
    streams: int
    chunk_bytes: int
    min_chunk_bytes: int
    hedge: bool
    timeout_s: float
    slow_start_after_idle: bool = False
    initial_window_segments: int = 10


@dataclass(frozen=True, slots=True)
class RouterConfig:
    ttft_target_s: float
    md_first_token_s: float
    rld_decode_rate: float | str
    catchup_slack: int
    max_concurrent_relays: int
    max_eager_tokens: int
    admission: bool
    link_estimate: str
    md_capacity: int
    link_bandwidth_bytes_s: float | str = "auto"


@dataclass(frozen=True, slots=True)
class HandoffConfig:
    mode: str
    catchup_threshold: int
    final_switch_size: int
    min_batch: int
    max_rounds: int
    recompute_rate: float | str
    fallback: str
    max_stall_s: float
    keep_strange_traffic: bool = False


@dataclass(frozen=True, slots=True)
class SlaConfig:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    seed: int
    sessions: int
    session_rate: float
    turns_mean: float
    think_s_mean: float
    system_prompt_tokens: int
    first_input_mean: float
    first_input_sigma: float
    output_mean: float
    output_sigma: float
    output_max: int
    max_tokens: int
    max_context: int
    low_hit_fraction: float
    low_hit_min: float
    low_hit_max: float
    high_hit_min: float
    high_hit_max: float
    trace: str


@dataclass(frozen=True, slots=True)
class QuickConfig:
    sessions: int


@dataclass(frozen=True, slots=True)
class SimConfig:
    """A whole simulator configuration (one field per TOML section)."""

    model: ModelConfig
    gpu: dict[str, GpuConfig]
    engine: EngineConfig
    cluster: ClusterConfig
    wan: WanConfig
    router: RouterConfig
    handoff: HandoffConfig
    sla: SlaConfig
    workload: WorkloadConfig
    quick: QuickConfig
    source: tuple[str, ...] = field(default=())

    def replace(self, section: str, **changes: Any) -> SimConfig:
        """A copy with ``changes`` applied to one section, validated again.

        Raises:
            SimConfigError: for an unknown section or key, or a bad value.
        """
        old = getattr(self, section, None)
        if old is None or section in ("gpu", "source"):
            raise SimConfigError("no such section", key=section)
        table = {**dataclasses.asdict(old), **changes}
        new = _section(type(old), table, section)
        out = dataclasses.replace(self, **{section: new})
        _check(out)
        return out


def _accepts(tp: Any, value: Any) -> bool:
    if isinstance(tp, types.UnionType):
        return any(_accepts(t, value) for t in typing.get_args(tp))
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _section(cls: type, table: Any, name: str) -> Any:
    if not isinstance(table, dict):
        raise SimConfigError("must be a table", key=name)
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    for key in table:
        if key not in names:
            raise SimConfigError(f"unknown key (have {', '.join(names)})", key=f"{name}.{key}")
    # a key with a default in the dataclass may be left out
    table = {
        **{f.name: f.default for f in fields if f.default is not dataclasses.MISSING},
        **table,
    }
    values = {}
    for key in names:
        if key not in table:
            raise SimConfigError("missing", key=f"{name}.{key}")
        value, tp = table[key], hints[key]
        if not _accepts(tp, value):
            raise SimConfigError(f"{value!r} is not a {tp}", key=f"{name}.{key}")
        values[key] = float(value) if tp is float else value
    return cls(**values)


def _merge(base: dict[str, Any], over: dict[str, Any], where: str = "") -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, f"{where}{key}.")
        else:
            out[key] = value
    return out


def _positive(cfg: SimConfig) -> None:
    checks: list[tuple[str, float]] = [
        ("model.params", cfg.model.params),
        ("model.layers", cfg.model.layers),
        ("model.kv_heads", cfg.model.kv_heads),
        ("model.head_dim", cfg.model.head_dim),
        ("model.attn_width", cfg.model.attn_width),
        ("model.dtype_bytes", cfg.model.dtype_bytes),
        ("engine.md_max_batch", cfg.engine.md_max_batch),
        ("engine.rld_max_batch", cfg.engine.rld_max_batch),
        ("cluster.prefill", cfg.cluster.prefill),
        ("cluster.main", cfg.cluster.main),
        ("cluster.kv_block_tokens", cfg.cluster.kv_block_tokens),
        ("cluster.local_bandwidth_bytes_s", cfg.cluster.local_bandwidth_bytes_s),
        ("wan.bandwidth_bps", cfg.wan.bandwidth_bps),
        ("wan.mss_bytes", cfg.wan.mss_bytes),
        ("wan.window_bytes", cfg.wan.window_bytes),
        ("wan.streams", cfg.wan.streams),
        ("wan.chunk_bytes", cfg.wan.chunk_bytes),
        ("wan.min_chunk_bytes", cfg.wan.min_chunk_bytes),
        ("wan.timeout_s", cfg.wan.timeout_s),
        ("wan.initial_window_segments", cfg.wan.initial_window_segments),
        ("sla.ttft_s", cfg.sla.ttft_s),
        ("sla.tpot_s", cfg.sla.tpot_s),
        ("workload.sessions", cfg.workload.sessions),
        ("workload.session_rate", cfg.workload.session_rate),
        ("workload.turns_mean", cfg.workload.turns_mean),
        ("workload.first_input_mean", cfg.workload.first_input_mean),
        ("workload.output_mean", cfg.workload.output_mean),
        ("workload.output_max", cfg.workload.output_max),
        ("workload.max_tokens", cfg.workload.max_tokens),
        ("quick.sessions", cfg.quick.sessions),
    ]
    for gname, g in cfg.gpu.items():
        checks += [
            (f"gpu.{gname}.hbm_bytes_s", g.hbm_bytes_s),
            (f"gpu.{gname}.flops", g.flops),
            (f"gpu.{gname}.memory_bytes", g.memory_bytes),
        ]
    for key, value in checks:
        if value <= 0:
            raise SimConfigError(f"must be > 0, got {value}", key=key)


def _check(cfg: SimConfig) -> None:
    _positive(cfg)
    c, e, w, wl = cfg.cluster, cfg.engine, cfg.wan, cfg.workload
    for key, gpu in (
        ("cluster.prefill_gpu", c.prefill_gpu),
        ("cluster.relay_gpu", c.relay_gpu),
        ("cluster.main_gpu", c.main_gpu),
    ):
        if gpu not in cfg.gpu:
            raise SimConfigError(f"no [gpu.{gpu}] section (have {sorted(cfg.gpu)})", key=key)
    for key, frac in (("engine.mfu", e.mfu), ("engine.mbu", e.mbu)):
        if not 0 < frac <= 1:
            raise SimConfigError(f"must lie in (0, 1], got {frac}", key=key)
    if not 0 < e.memory_reserve <= 1:
        raise SimConfigError("must lie in (0, 1]", key="engine.memory_reserve")
    if c.relay < 0:
        raise SimConfigError("must be >= 0", key="cluster.relay")
    if c.baseline_relay_as not in ("prefill", "none"):
        raise SimConfigError('must be "prefill" or "none"', key="cluster.baseline_relay_as")
    if c.sink not in ("decoder", "prefill"):
        raise SimConfigError('must be "decoder" or "prefill"', key="cluster.sink")
    for gname, g in cfg.gpu.items():
        if g.pace_s < 0 or g.per_request_s < 0:
            raise SimConfigError("must be >= 0", key=f"gpu.{gname}.pace_s/per_request_s")
    if not 0 <= w.loss < 1:
        raise SimConfigError("must lie in [0, 1)", key="wan.loss")
    if w.rtt_s < 0 or w.jitter_s < 0 or c.local_rtt_s < 0 or e.pass_overhead_s < 0:
        raise SimConfigError("delays must be >= 0", key="wan.rtt_s/jitter_s/local_rtt_s")
    for key, rate in (
        ("router.rld_decode_rate", cfg.router.rld_decode_rate),
        ("router.link_bandwidth_bytes_s", cfg.router.link_bandwidth_bytes_s),
        ("handoff.recompute_rate", cfg.handoff.recompute_rate),
    ):
        if isinstance(rate, str) and rate != "auto":
            raise SimConfigError(f'a number or "auto", got {rate!r}', key=key)
        if not isinstance(rate, str) and rate <= 0:
            raise SimConfigError(f"must be > 0, got {rate}", key=key)
    if cfg.router.md_capacity < 0:
        raise SimConfigError("must be >= 0", key="router.md_capacity")
    if cfg.router.link_estimate not in ("sampled", "fair-share"):
        raise SimConfigError('"sampled" or "fair-share"', key="router.link_estimate")
    if cfg.handoff.mode not in ("one-shot", "catch-up"):
        raise SimConfigError('"one-shot" or "catch-up"', key="handoff.mode")
    if cfg.handoff.fallback not in ("one-shot", "keep-rld", "auto"):
        raise SimConfigError('"one-shot", "keep-rld" or "auto"', key="handoff.fallback")
    for lo_key, lo, hi in (
        ("workload.low_hit_min", wl.low_hit_min, wl.low_hit_max),
        ("workload.high_hit_min", wl.high_hit_min, wl.high_hit_max),
    ):
        if not 0 <= lo <= hi < 1:
            raise SimConfigError(f"need 0 <= min <= max < 1, got [{lo}, {hi}]", key=lo_key)
    if not 0 <= wl.low_hit_fraction <= 1:
        raise SimConfigError("must lie in [0, 1]", key="workload.low_hit_fraction")
    # Simulated token ids are (session + 1) * 2**17 + position (docs/sim.md):
    # unique per session and position, below 2**32.
    if wl.max_context > 1 << 17 or wl.system_prompt_tokens >= wl.max_context:
        raise SimConfigError(
            "must be at most 131072 and above system_prompt_tokens", key="workload.max_context"
        )
    if max(wl.sessions, cfg.quick.sessions) >= (1 << 15) - 1:
        raise SimConfigError("at most 32766 sessions", key="workload.sessions")
    if wl.output_max > wl.max_tokens:
        raise SimConfigError("output_max must be <= max_tokens", key="workload.output_max")


def load_config(path: str | Path | None = None, **overrides: Any) -> SimConfig:
    """The default configuration, overridden by the TOML file ``path`` and then
    by ``overrides`` (section name -> {key: value}).

    Raises:
        SimConfigError: for an unreadable file, an unknown key, a wrong type
            or a value out of range (the error names the key).
    """
    raw = tomllib.loads(K_DEFAULT_PATH.read_text())
    sources = [str(K_DEFAULT_PATH)]
    if path is not None:
        try:
            user = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SimConfigError(f"can't read it: {exc}", key=str(path)) from exc
        for key in user:
            if key not in raw:
                raise SimConfigError(f"unknown section (have {', '.join(raw)})", key=key)
        raw = _merge(raw, user)
        sources.append(str(path))
    for key in overrides:
        if key not in raw:
            raise SimConfigError("unknown section", key=key)
    raw = _merge(raw, overrides)
    gpus = raw["gpu"]
    if not isinstance(gpus, dict) or not gpus:
        raise SimConfigError("needs at least one [gpu.NAME] table", key="gpu")
    cfg = SimConfig(
        model=_section(ModelConfig, raw["model"], "model"),
        gpu={name: _section(GpuConfig, t, f"gpu.{name}") for name, t in gpus.items()},
        engine=_section(EngineConfig, raw["engine"], "engine"),
        cluster=_section(ClusterConfig, raw["cluster"], "cluster"),
        wan=_section(WanConfig, raw["wan"], "wan"),
        router=_section(RouterConfig, raw["router"], "router"),
        handoff=_section(HandoffConfig, raw["handoff"], "handoff"),
        sla=_section(SlaConfig, raw["sla"], "sla"),
        workload=_section(WorkloadConfig, raw["workload"], "workload"),
        quick=_section(QuickConfig, raw["quick"], "quick"),
        source=tuple(sources),
    )
    _check(cfg)
    return cfg
