"""The two processes of ``pddnet bench handoff``: MD (in DC-B) and RLD (in DC-A).

Both run as ``python -m pddnet.bench._handoff_peer md|rld CONFIG_JSON`` (on an
emulated WAN host via :meth:`pddnet.emu.Host.spawn`, or as plain local
processes on loopback) and talk JSON lines on stdout:

* MD prints ``{"ready": {...addresses}}``, then one ``{"md": {...}}`` line per
  handled request (its own compute and copy times), and serves until killed;
* RLD prints ``{"progress": k}`` per repetition and finally ``{"result": {...}}``.

Timing (one clock: RLD's ``trio.current_time()``)
-------------------------------------------------
MD first prepares each repetition, untimed: it resets its sequence to the
prompt KV and grants the destination slots of the N new tokens
(``WanGrantRequest`` -> ``WanGrant``). Then, in alternating order:

* **ship-KV**: RLD starts a :class:`~pddnet.transport.wan.WanSender` transfer
  of the N tokens' KV (token-granular ranges) into the grant; MD's
  :class:`~pddnet.transport.wan.WanReceiver` receives straight into its pool
  (``recv_into`` the slots; on a GPU, into host staging and then one
  host-to-device copy and scatter, timed). When every byte is verified and in
  place MD sends ``KvReady`` over the control plane; the latency is RLD's start
  to ``KvReady`` received.
* **token-IDs**: RLD sends a ``TokenBatch`` request over the control plane; MD
  decodes it, runs one ``extend`` of the N tokens over the prompt KV, takes
  the next token (which waits for the device) and replies ``HandoffAck``; the
  latency is the request's round trip.

So both latencies end with the same kind of one-way control message from MD
back to RLD, and include the same half RTT on the return leg. RLD connects to
MD's control plane with ``control_paths`` TCP connections (MD answers on every
one it has heard RLD on): every control frame of *both* methods (token batch
and ack; grant and ``KvReady``) travels once per path.

One TCP setting for both methods
--------------------------------
``tcp`` (``wan`` or ``default``) is applied alike to the control connections
(through :class:`~pddnet.control.ControlNode`) and to the WAN data streams
that carry the KV: before each repetition, untimed, both nodes set the same
options on every connection of the WAN port (:func:`tune_wan_sockets`) and
read ``TCP_RTO_MIN_US`` back, which the result reports. So the KV path's bulk
streams get the 5 ms RTO floor and delayed-ACK ceiling exactly when the
token-ID path's control connections do.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from typing import Any

import numpy as np

K_READY_TIMEOUT = 10.0


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _tcp_tuning(cfg: dict[str, Any]) -> Any:
    """The control plane's TCP options: ``wan`` (5 ms RTO floor and delayed ACK) or None."""
    from ..control import TcpTuning

    return TcpTuning.wan() if cfg.get("tcp") == "wan" else None


def tune_wan_sockets(port: int, local: bool, tuning: Any) -> list[int | None]:
    """Set ``tuning``'s options on this process's TCP connections of the WAN port.

    Args:
        port: the WAN receiver's port.
        local: whether ``port`` is this side's (MD, accepted connections) or
            the peer's (RLD, connections it made). Listening sockets are skipped.
        tuning: a :class:`~pddnet.control.TcpTuning`, or None to set nothing.

    Returns:
        ``TCP_RTO_MIN_US`` read back from each connection, in microseconds (the
        system's 200 000 when untuned; None where the kernel lacks the option).
    """
    from ..control._tcp import K_TCP_RTO_MIN_US

    out: list[int | None] = []
    for name in os.listdir("/proc/self/fd"):
        try:
            dup = os.dup(int(name))
        except OSError:
            continue  # closed meanwhile
        try:
            sock = socket.socket(fileno=dup)
        except OSError:  # not a socket
            os.close(dup)
            continue
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM or sock.family != socket.AF_INET:
                    continue
                ends = (sock.getsockname(), sock.getpeername())
            except OSError:
                continue  # not connected: a listener, or already reset
            if ends[0 if local else 1][1] != port:
                continue
            try:
                for _, opt, value in tuning.options() if tuning is not None else ():
                    sock.setsockopt(socket.IPPROTO_TCP, opt, value)
                out.append(sock.getsockopt(socket.IPPROTO_TCP, K_TCP_RTO_MIN_US))
            except OSError:
                out.append(None)
    return out


# -- MD ------------------------------------------------------------------------------


class _MainDecode:
    """MD's state: the model with its prompt KV, the pool the KV is shipped into."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        from ..kv import KVLayout, KVPool
        from ..recompute import BlockAllocator, ModelConfig, ReferenceModel, Weights, greedy

        self.cfg = cfg
        self.model_cfg = ModelConfig.from_dict(cfg["model"])
        self.kv_layout = KVLayout.from_dict(cfg["kv_layout"])
        self.prefix_len = int(cfg["prefix_len"])
        bs = self.kv_layout.block_size
        per_seq = -(-(self.prefix_len + int(cfg["max_tokens"])) // bs)
        num_blocks = 2 * per_seq + 1
        weights = Weights.random(self.model_cfg, int(cfg["seed"]))
        self.device = cfg["device"]
        if self.device == "cupy":
            from .._optional import require

            cp = require("cupy")
            layout = self.model_cfg.kv_layout(bs, "float32")
            bufs = [
                cp.zeros(layout.buffer_shape(num_blocks), cp.float32)
                for _ in range(layout.num_buffers())
            ]
            self.model = ReferenceModel(
                self.model_cfg, weights, KVPool(layout, bufs), allocator=BlockAllocator(num_blocks)
            )
        else:
            self.model = ReferenceModel.create(
                self.model_cfg, num_blocks, block_size=bs, weights=weights
            )
        self.greedy = greedy
        # shipped KV lands in the model's own pool when it is a host pool of the same
        # layout; otherwise in a host pool of the shipped layout (same block ids)
        if cfg["shared_pool"] and self.device != "cupy":
            self.ship_pool = self.model.pool
        else:
            self.ship_pool = KVPool.allocate(self.kv_layout, num_blocks)
        rng = np.random.default_rng(int(cfg["seed"]))
        self.prefix = self.model.new_sequence()
        prompt = rng.integers(0, self.model_cfg.vocab_size, self.prefix_len)
        self.model.prefill(self.prefix, prompt)
        self.work = self.model.new_sequence(per_seq * bs)
        self.reset()

    def reset(self) -> None:
        """Give the work sequence a copy of the prompt KV (what MD holds before handoff)."""
        xp = self.model.xp
        src = self.prefix.blocks_in_use(self.kv_layout.block_size)
        dst = xp.asarray(self.work.block_table[: src.size])
        src = xp.asarray(src)
        for buf in self.model.pool.buffers:
            buf[dst] = buf[src]
        self.work.length = self.prefix_len

    def recompute(self, tokens: list[int]) -> float:
        """One extend of ``tokens`` after the prompt; returns seconds (device included)."""
        self.work.length = self.prefix_len
        t0 = time.perf_counter()
        self.greedy(self.model.extend(self.work, tokens))  # host int: waits for the GPU
        return time.perf_counter() - t0

    def copy_into_place(self, n: int) -> float:
        """Host staging -> device pool for the N shipped tokens (GPU only); seconds."""
        if self.device != "cupy":
            return 0.0
        from .._optional import require

        cp = require("cupy")
        t0 = time.perf_counter()
        bs = self.kv_layout.block_size
        pos = np.arange(self.prefix_len, self.prefix_len + n)
        blocks, slots = self.work.block_table[pos // bs], pos % bs
        # the staging pool has the shipped layout; view it as the model's float32 one
        # when they match, else copy raw bytes (the cost is what is measured)
        staged = np.stack([np.asarray(b)[blocks, :, slots] for b in self.ship_pool.buffers])
        dev = cp.asarray(staged)
        if self.ship_pool.layout == self.model.pool.layout:
            for layer, buf in enumerate(self.model.pool.buffers):
                buf[cp.asarray(blocks), :, cp.asarray(slots)] = dev[layer]
        cp.cuda.Device().synchronize()
        return time.perf_counter() - t0


def md_main(cfg: dict[str, Any]) -> None:
    """Serve MD until killed (see the module docstring)."""
    import trio

    from ..control import ControlNode
    from ..handoff import HandoffAck, KvReady, TokenBatch
    from ..recompute import limit_blas_threads
    from ..transport.wan import WanGrant, WanGrantRequest, WanReceiver
    from ..wire import decode_tokens
    from ._handoff_plan import token_ranges

    limit_blas_threads(1)
    if cfg.get("nice"):
        with contextlib.suppress(OSError):  # needs root (CAP_SYS_NICE) to go below 0
            os.nice(int(cfg["nice"]))
    md = _MainDecode(cfg)
    tuning = _tcp_tuning(cfg)

    async def main() -> None:
        bind = cfg["bind"]
        async with (
            ControlNode(
                "md",
                secret=bytes.fromhex(cfg["secret"]),
                bind=f"tcp://{bind}:0",
                tcp=tuning,
            ) as node,
            WanReceiver(bind, 0, max_chunk=16 << 20) as rx,
            trio.open_nursery() as nursery,
        ):

            async def land(rid: int, tid: int, n: int, peer: str) -> None:
                try:
                    await rx.wait_transfer(tid)
                except Exception as exc:  # the sender sees the failure too
                    _emit({"md": {"rid": rid, "error": repr(exc)}})
                    return
                copy_s = md.copy_into_place(n)
                await node.send(peer, KvReady(rid))
                _emit({"md": {"rid": rid, "kind": "kv", "copy_s": copy_s}})

            def on_prepare(peer: str, msg: WanGrantRequest) -> WanGrant:
                rid_s, _, n_s = msg.request_id.partition(":")
                rid, n = int(rid_s), int(n_s)
                md.reset()
                rto = tune_wan_sockets(wan_port, True, tuning)
                _emit({"md": {"rid": rid, "kind": "grant", "wan_rto_min_us": rto}})
                ranges = token_ranges(
                    md.kv_layout, md.ship_pool.num_blocks, md.work.block_table, md.prefix_len, n
                )
                grant = rx.grant(md.ship_pool.host_views(), ranges, timeout=60.0)
                nursery.start_soon(land, rid, grant.transfer_id, n, peer)
                return WanGrant.from_grant(grant, msg.request_id)

            def on_tokens(peer: str, msg: TokenBatch) -> HandoffAck:
                tokens = [int(t) for t in decode_tokens(msg.tokens, 1 << 16)]
                secs = md.recompute(tokens)
                cs = node.statistics()
                _emit(
                    {
                        "md": {
                            "rid": msg.request_id,
                            "kind": "tokens",
                            "compute_s": secs,
                            # cumulative: copies MD dropped, extra copies it sent
                            "control_duplicates": cs.duplicates,
                            "control_copies_sent": cs.copies_sent,
                        }
                    }
                )
                rate = int(len(tokens) / secs) if secs > 0 else 0
                return HandoffAck(msg.request_id, msg.start + len(tokens), True, rate)

            node.route(WanGrantRequest, on_prepare)
            node.route(TokenBatch, on_tokens)
            ctrl_port = int(node.address.rsplit(":", 1)[1])
            wan_port = int(rx.address.rsplit(":", 1)[1])
            _emit({"ready": {"control_port": ctrl_port, "wan_port": wan_port}})
            await trio.sleep_forever()

    trio.run(main)


# -- RLD -----------------------------------------------------------------------------


def token_frame_bytes(msg: Any, secret: bytes) -> int:
    """Bytes of the authenticated control frame that carries ``msg`` RLD -> MD."""
    from ..wire import FrameKind, SeqClock, encode_frame

    frame = encode_frame(
        msg,
        key=secret,
        src="rld",
        dst="md",
        seq=SeqClock().next(),
        corr=1 << 20,
        kind=FrameKind.REQUEST,
    )
    return len(frame)


def rld_main(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run every repetition against MD; returns (and prints) the measurements."""
    import trio

    from .._errors import RemoteProtocolError
    from ..control import ControlNode
    from ..handoff import HandoffAck, KvReady, TokenBatch
    from ..kv import KVLayout, KVPool
    from ..transport.wan import WanGrant, WanGrantRequest, WanSender
    from ..wire import K_CHUNK_HEADER_SIZE
    from ._handoff_plan import token_ranges

    secret = bytes.fromhex(cfg["secret"])
    tuning = _tcp_tuning(cfg)
    wan_port = int(cfg["md_wan"].rsplit(":", 1)[1])
    layout = KVLayout.from_dict(cfg["kv_layout"])
    prefix_len = int(cfg["prefix_len"])
    bs = layout.block_size
    points: list[int] = [int(n) for n in cfg["tokens"]]
    repeat, warmup = int(cfg["repeat"]), int(cfg["warmup"])
    per_seq = -(-(prefix_len + max(points)) // bs)
    src_pool = KVPool.allocate(layout, per_seq, fill=None)
    rng = np.random.default_rng(int(cfg["seed"]) + 1)
    for b in src_pool.buffers:
        b.view(np.uint8)[...] = rng.integers(0, 256, b.nbytes, dtype=np.uint8).reshape(
            b.view(np.uint8).shape
        )
    src_table = np.arange(per_seq)
    vocab = int(cfg["vocab"])
    out: dict[str, Any] = {"points": []}

    async def main() -> None:
        async with (
            ControlNode("rld", secret=secret, bind="tcp://127.0.0.1:0", tcp=tuning) as node,
            WanSender(
                cfg["md_wan"],
                streams=int(cfg["streams"]),
                chunk_size=int(cfg["chunk"]),
            ) as tx,
        ):
            arrived: dict[int, trio.Event] = {}

            def on_kv_ready(peer: str, msg: KvReady) -> None:
                ev = arrived.get(msg.request_id)
                if ev is not None:
                    ev.set()

            node.route(KvReady, on_kv_ready)
            paths = int(cfg.get("control_paths", 1))
            await node.connect("md", cfg["md_control"], paths=paths)
            with trio.fail_after(K_READY_TIMEOUT):
                while True:
                    try:
                        await node.ping("md", timeout=1.0)
                        break
                    except Exception:
                        await trio.sleep(0.05)
                await tx.wait_connected()

            def wire_bytes() -> int:
                st = tx.statistics()
                chunks = sum(x.chunks_sent for x in st.streams)
                return st.bytes_sent + chunks * K_CHUNK_HEADER_SIZE

            async def ship(rid: int, grant: Any, src_ranges: Any) -> tuple[float, int]:
                ev = arrived[rid] = trio.Event()
                sent0 = wire_bytes()
                t0 = trio.current_time()
                transfer = tx.start(grant, src_pool.host_views(), src_ranges, timeout=60)
                with trio.fail_after(60):
                    await ev.wait()
                dt = trio.current_time() - t0
                await transfer.wait()
                del arrived[rid]
                return dt, wire_bytes() - sent0

            async def recompute(batch: TokenBatch, position: int) -> float:
                t0 = trio.current_time()
                ack = await node.request("md", batch, timeout=60)
                dt = trio.current_time() - t0
                if not isinstance(ack, HandoffAck) or ack.position != position:
                    raise RemoteProtocolError(f"bad ack {ack!r}", peer="md")
                return dt

            rid = 0
            done = 0
            rto: list[int | None] = []
            for n in points:
                src_ranges = token_ranges(layout, per_seq, src_table, prefix_len, n)
                kv_s: list[float] = []
                tok_s: list[float] = []
                kv_wire: list[int] = []
                rids: list[int] = []
                tok_bytes = frame_bytes = 0
                for r in range(warmup + repeat):
                    rid += 1
                    reply = await node.request(
                        "md",
                        WanGrantRequest(f"{rid}:{n}", n * layout.kv_bytes_per_token),
                        timeout=30,
                    )
                    assert isinstance(reply, WanGrant)
                    grant = reply.to_grant()
                    rto = tune_wan_sockets(wan_port, False, tuning)
                    tokens = [int(t) for t in rng.integers(0, vocab, n)]
                    batch = TokenBatch.build(rid, prefix_len, tokens, True)
                    frame_bytes = token_frame_bytes(batch, secret)
                    tok_bytes = frame_bytes * paths  # one copy per control path

                    if r % 2:  # alternate, so drift hits both methods alike
                        t_tok = await recompute(batch, prefix_len + n)
                        t_kv, wire = await ship(rid, grant, src_ranges)
                    else:
                        t_kv, wire = await ship(rid, grant, src_ranges)
                        t_tok = await recompute(batch, prefix_len + n)
                    if r >= warmup:
                        kv_s.append(t_kv)
                        tok_s.append(t_tok)
                        kv_wire.append(wire)
                        rids.append(rid)
                        done += 1
                        _emit({"progress": done})
                    await trio.sleep(float(cfg["gap"]))
                out["points"].append(
                    {
                        "tokens": n,
                        "kv_s": kv_s,
                        "token_s": tok_s,
                        "kv_payload_bytes": n * layout.kv_bytes_per_token,
                        "kv_wire_bytes": kv_wire,
                        "request_ids": rids,
                        # the WAN sender's pacing after this point (None: unpaced)
                        "pacing": {
                            "rate_per_stream": tx.statistics().rate_per_stream,
                            "active_streams": tx.statistics().active_streams,
                        },
                        "token_payload_bytes": tok_bytes,
                        "token_frame_bytes": frame_bytes,
                        "chunks_per_transfer": -(
                            -n * layout.kv_bytes_per_token // int(cfg["chunk"])
                        ),
                    }
                )
            cs = node.statistics()
            out["tcp"] = {
                "setting": cfg.get("tcp", "default"),
                "control_connections_tuned": cs.tcp_tuned,
                # the KV streams at RLD's last repetition (MD's: its "grant" lines)
                "wan_rto_min_us": rto,
            }
            out["control"] = {
                "paths": paths,
                "tcp_tuned": cs.tcp_tuned,
                "frames_sent": cs.sent,
                "copies_sent": cs.copies_sent,
                "duplicates_dropped": cs.duplicates,
                "late_replies": cs.late_replies,
            }
            st = tx.statistics()
            out["sender"] = {
                "bytes_resent": st.bytes_resent,
                "chunks_hedged": st.chunks_hedged,
                "congestion": st.streams[0].congestion if st.streams else "",
            }

    trio.run(main)
    _emit({"result": out})
    return out


if __name__ == "__main__":
    role, config = sys.argv[1], json.loads(sys.argv[2])
    if role == "md":
        md_main(config)
    elif role == "rld":
        rld_main(config)
    else:
        raise SystemExit(f"unknown role {role}")
