"""The simulator's physical models: engines, the WAN, hardware cost.

Each model is a small class over its configuration section; docs/sim.md
states where each parameter comes from. They are rooflines and fair shares,
not fits: nothing here was tuned against the PDD source's results.
"""

from __future__ import annotations

import math

from ._config import ClusterConfig, EngineConfig, GpuConfig, ModelConfig, SimConfig, WanConfig

__all__ = ["EngineModel", "HardwareModel", "WanModel"]

K_MATHIS_C = math.sqrt(1.5)  # Mathis et al. 1997: rate <= MSS / RTT * sqrt(3/2) / sqrt(p)


class EngineModel:
    """Forward-pass times of one GPU serving the model (a roofline).

    A pass takes ``overhead + max(memory time, compute time)``, plus the
    GPU type's ``pace_s`` and ``per_request_s`` for each request in it (both
    0 for a GPU; the demo's reference engine has them):

    * memory time: the weights once, plus the KV read by attention, at
      ``mbu`` of the HBM bandwidth;
    * compute time: ``2 * params`` FLOPs per token for the dense layers, plus
      attention's ``4 * layers * attn_width * context`` FLOPs per token, at
      ``mfu`` of peak.

    Decode (one token per request) is memory bound; prefill of many tokens is
    compute bound; an extend (MD's recompute of RLD's tokens) of ``k`` tokens
    costs about one decode step while ``k`` is small, so its throughput,
    ``k / extend_s(k)``, collapses for small tail chunks: the inefficiency the
    source blames for its valleys.

    Args:
        model: the model's size.
        gpu: the GPU type.
        engine: efficiencies and overhead.
    """

    def __init__(self, model: ModelConfig, gpu: GpuConfig, engine: EngineConfig) -> None:
        self.model = model
        self.gpu = gpu
        self._bw = gpu.hbm_bytes_s * engine.mbu
        self._flops = gpu.flops * engine.mfu
        self._overhead = engine.pass_overhead_s + gpu.pace_s
        self._per_request = gpu.per_request_s
        self._kvpt = model.kv_bytes_per_token
        self._weights_s = model.weight_bytes / self._bw
        self._dense = 2.0 * model.params  # FLOPs per token
        self._attn = 4.0 * model.layers * model.attn_width  # FLOPs per token per context token

    def _pass_s(
        self, tokens: int, attended: float, kv_read_tokens: float, requests: int = 1
    ) -> float:
        """``tokens`` new tokens of ``requests`` requests attending to
        ``attended`` context positions in total, reading ``kv_read_tokens``
        tokens' KV from HBM."""
        memory = self._weights_s + kv_read_tokens * self._kvpt / self._bw
        compute = (self._dense * tokens + self._attn * attended) / self._flops
        return self._overhead + requests * self._per_request + max(memory, compute)

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Prefill ``new_tokens`` after ``cached_tokens`` already in the KV cache."""
        attended = new_tokens * (cached_tokens + new_tokens / 2)
        return self._pass_s(new_tokens, attended, cached_tokens + new_tokens)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` requests holding ``context_tokens`` in all."""
        return self._pass_s(batch, context_tokens, context_tokens, batch)

    def decode_steps_s(self, batch: int, context_tokens: int, steps: int) -> float:
        """``steps`` consecutive decode steps of ``batch`` requests, the context
        growing by ``batch`` tokens a step (the sum of :meth:`decode_step_s`).

        Both sides of the roofline are linear in the context, so one of them
        dominates a whole run of steps unless they cross inside it; the sum
        is then closed-form (an arithmetic series), else summed step by step.
        """
        if steps <= 0:
            return 0.0
        kv = self._kvpt / self._bw
        mem0, mem_slope = self._weights_s + kv * context_tokens, kv * batch
        attn = self._attn / self._flops
        cmp0, cmp_slope = self._dense * batch / self._flops + attn * context_tokens, attn * batch
        last = steps - 1
        mem_wins = mem0 >= cmp0, mem0 + mem_slope * last >= cmp0 + cmp_slope * last
        if mem_wins[0] != mem_wins[1]:
            return sum(self.decode_step_s(batch, context_tokens + i * batch) for i in range(steps))
        base, slope = (mem0, mem_slope) if mem_wins[0] else (cmp0, cmp_slope)
        fixed = self._overhead + batch * self._per_request
        return steps * (fixed + base) + slope * steps * last / 2

    def extend_s(self, tokens: int, context_tokens: int) -> float:
        """One extend pass of ``tokens`` after ``context_tokens`` of one request."""
        return self.prefill_s(tokens, context_tokens)

    def step_with_extend_s(
        self,
        batch: int,
        context_tokens: int,
        extend_tokens: int,
        extend_context: int,
        extend_requests: int = 1,
    ) -> float:
        """A decode step with the extend tokens of ``extend_requests`` requests
        batched into it (``batch_tails``)."""
        attended = context_tokens + extend_tokens * (extend_context + extend_tokens / 2)
        return self._pass_s(
            batch + extend_tokens,
            attended,
            context_tokens + extend_context,
            batch + extend_requests,
        )

    def kv_pool_tokens(self, reserve: float) -> int:
        """Tokens of KV the GPU's memory holds beside the weights."""
        free = (self.gpu.memory_bytes - self.model.weight_bytes) * reserve
        return max(0, int(free // self._kvpt))


class WanModel:
    """The DC-A -> DC-B link as delivered goodput shared by TCP streams.

    Every stream that is sending gets an equal share of the link's goodput,
    ``bandwidth * (1 - loss)``, and at most what one TCP stream can carry:
    its window per round trip (``window_bytes / rtt``) and, with loss,
    Mathis' bound ``MSS / RTT * sqrt(3/2) / sqrt(loss)``. A chunk's
    serialisation uses the share at the moment it starts; it arrives one
    one-way delay later, plus a jitter draw (half-normal).

    Args:
        wan: the link's configuration.
    """

    def __init__(self, wan: WanConfig) -> None:
        self.wan = wan
        self.goodput_bytes_s = wan.bandwidth_bps / 8 * (1 - wan.loss)
        cap = wan.window_bytes / wan.rtt_s if wan.rtt_s > 0 else math.inf
        if wan.loss > 0 and wan.rtt_s > 0:
            cap = min(cap, wan.mss_bytes / wan.rtt_s * K_MATHIS_C / math.sqrt(wan.loss))
        self.stream_cap_bytes_s = cap
        self.one_way_s = wan.rtt_s / 2
        # Linux restarts an idle stream's window after one RTO: srtt plus at
        # least TCP_RTO_MIN (200 ms)
        self.rto_s = wan.rtt_s + 0.2
        self._initial_window = wan.initial_window_segments * wan.mss_bytes

    def stream_rate(self, sending_streams: int) -> float:
        """Bytes/s of one stream while ``sending_streams`` (itself included) send."""
        return min(self.goodput_bytes_s / max(1, sending_streams), self.stream_cap_bytes_s)

    def send_s(self, nbytes: int, rate: float, idle_s: float) -> float:
        """Seconds one stream takes to put ``nbytes`` on the wire at ``rate``
        after ``idle_s`` without sending.

        With ``slow_start_after_idle`` a stream idle past its RTO starts
        from the initial window: each round trip sends a window and doubles
        it, until the window covers ``rate x RTT`` (then ``rate`` holds)."""
        if not self.wan.slow_start_after_idle or idle_s <= self.rto_s or self.wan.rtt_s <= 0:
            return nbytes / rate
        t, left, window, full = 0.0, nbytes, self._initial_window, rate * self.wan.rtt_s
        while window < full and left > window:
            left -= window
            t += self.wan.rtt_s
            window *= 2
        return t + left / rate

    def single_transfer_bytes_s(self) -> float:
        """Goodput one sender with the link to itself gets (the router's first estimate)."""
        return min(self.goodput_bytes_s, self.wan.streams * self.stream_cap_bytes_s)


class HardwareModel:
    """GPU counts per role and their price.

    The baseline has no RLD role: with ``baseline_relay_as = "prefill"`` its
    relay GPUs prefill (the same cluster, the same cost); with ``"none"``
    they are not bought.

    Args:
        cfg: the configuration (cluster counts and GPU prices).
    """

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg

    def instances(self, baseline: bool) -> dict[str, list[str]]:
        """Role -> the GPU type of each of its instances (one GPU each)."""
        c = self.cfg.cluster
        prefill = [c.prefill_gpu] * c.prefill
        relay = [c.relay_gpu] * c.relay
        if baseline:
            prefill += relay if c.baseline_relay_as == "prefill" else []
            relay = []
        return {"prefill": prefill, "relay": relay, "main": [c.main_gpu] * c.main}

    def counts(self, baseline: bool) -> dict[str, int]:
        """GPUs per role."""
        return {role: len(g) for role, g in self.instances(baseline).items()}

    def cost_per_hour(self, baseline: bool) -> float:
        """USD per hour of the cluster."""
        g = self.cfg.gpu
        return sum(g[t].price_per_hour for ts in self.instances(baseline).values() for t in ts)


def cluster_kv_block_bytes(model: ModelConfig, cluster: ClusterConfig) -> int:
    """Bytes of one simulated KV block."""
    return cluster.kv_block_tokens * model.kv_bytes_per_token
