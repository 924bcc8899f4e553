"""Fault soak: continuous requests through P, RLD and MD with random faults.

Each *episode* starts the three roles as processes (``_faults_peer.py``) on a
fresh emulated WAN (as root; otherwise on loopback), runs a continuous stream
of random requests with per-request deadlines, and injects one fault at a
random moment while requests are in flight:

* ``none``: no fault (control);
* ``link_down``: the WAN carries nothing for 2 s (the forwarder is paused;
  on loopback MD is SIGSTOPped instead);
* ``burst_loss``: Gilbert-Elliott bursty loss on the WAN for the whole episode;
* ``stream_reset``: every TCP connection between P and MD is reset (``ss -K``);
* ``kill_p`` / ``kill_rld`` / ``kill_md``: ``kill -9`` of that process.

The user reads each request through P's :class:`~pddnet.api.TokenSink`.
Every request must finish with the single-instance greedy tokens or fail with
a typed error (``RequestAborted``, ``PeerUnavailable``, ``TransferTimeout``,
or a typed exception from ``submit``) by its deadline. After the episode P's
lease table must be empty, P's pool back to its baseline, and each surviving
decoder idle with every block either free or in MD's radix cache. P journals
every request to a file outside its process, so a killed P's requests are
counted too: those it had finished keep their outcome, those still in flight
end as ``killed_with_p`` (their user died with P). The summary counts
``completed``, ``typed_errors`` (``deadline_timeouts`` of them ended by the
sink at the deadline: typed, but possibly a stuck decoder; ``killed_with_p``
of them cut off by a P kill), ``lost`` (no outcome recorded), ``hung`` (the
stream had not ended 1 s after the deadline, a decoder was still busy after
settling, or a surviving decoder did not answer the probe at all:
``unreachable_survivors``; ``hung_error_at_p`` of them did give P's engine a
typed error in time, as ``BlocksReleased.error``),
``corrupted`` (a request whose stream is wrong: ``wrong_token``,
``missing_position`` in a finished stream, or ``duplicate_position``),
``leaked_blocks``, ``crashed`` (a decoder that died although no fault killed
it) and ``rss_growth`` (bytes, the largest growth of one role process within
an episode). What the run lacks to inject its faults as asked (the emulated
WAN; ``ss`` for ``stream_reset``, whose episodes are then not run) is named
below the tables with how to get it, and in the summary's ``missing_peers``.
See docs/reliability.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..emu import GilbertElliott, Testbed, emulated_wan, netem_available, unavailable_reason
from ..recompute import TINY, ReferenceModel, greedy
from ._common import K_EMU_HOW, add_common_arguments, print_missing, print_table, write_report
from ._faults_peer import rss_kb

__all__ = [
    "FAULTS",
    "add_arguments",
    "check_episode",
    "journal_requests",
    "main",
    "missing_peers",
    "passed",
    "reference",
    "run_episode",
    "totals",
]

FAULTS = ("none", "link_down", "burst_loss", "stream_reset", "kill_p", "kill_rld", "kill_md")
# the faults a long-lived run repeats: the ones every process survives
K_SURVIVABLE = ("link_down", "stream_reset")
K_LONG_FAULT_EVERY_S = (5.0, 15.0)
K_LINK_DOWN_S = 2.0
K_ROUTES = ("auto", "p-md", "p-rld-md")
_ROLES = ("prefill", "relay", "main")
_KILLED = {"kill_p": "prefill", "kill_rld": "relay", "kill_md": "main"}  # fault -> its victim
# the outcome of a request still in flight when P, which also hosts its user, was killed
K_KILLED_WITH_P = "killed_with_p"
_PEER = [sys.executable, "-m", "pddnet.bench._faults_peer"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, png=False)
    parser.add_argument("--duration", type=float, default=None, help="total seconds (soak)")
    parser.add_argument("--episode", type=float, default=6.0, help="seconds of traffic each")
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--loopback", action="store_true", help="skip the emulated WAN")
    parser.add_argument(
        "--parallel", type=int, default=4, help="episodes at once (each has its own WAN)"
    )
    parser.add_argument(
        "--deadline", type=float, default=None, help="per-request deadline, s (8 quick, 15)"
    )
    parser.add_argument(
        "--routes", default=",".join(K_ROUTES), help="routes to draw from (auto,p-md,p-rld-md)"
    )
    parser.add_argument(
        "--long-lived",
        action="store_true",
        help="one set of processes for the whole --duration, with link-down and stream-reset "
        "faults every 5-15 s, and their memory sampled every 10 s (a slow-leak check)",
    )


def base_config(
    seed: int,
    duration_s: float,
    concurrency: int = 3,
    routes: tuple[str, ...] = K_ROUTES,
    request_timeout_s: float = 15.0,
) -> dict[str, Any]:
    """The roles' configuration (addresses are filled in per episode)."""
    return {
        "routes": list(routes),
        "blocks": 1024,
        "step_time_s": 0.01,
        "rtt_s": 0.02,
        "lease_s": 3.0,
        "request_timeout_s": request_timeout_s,
        # P's transfer timeout: short enough that its typed error reaches the
        # user before the request's deadline
        "transfer_timeout_s": 0.75 * request_timeout_s,
        "settle_s": 12.0,
        "duration_s": duration_s,
        "concurrency": concurrency,
        "max_tokens": 24,
        "seed": seed,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _link(fault: str, loopback: bool, seed: int) -> Iterator[Testbed | None]:
    if loopback or unavailable_reason() is not None:
        yield None
        return
    ge = GilbertElliott(p=0.02, r=0.25) if fault == "burst_loss" else None
    with emulated_wan("20ms", rate="200mbit", mtu=1500, ge=ge, seed=seed) as wan:
        yield wan


class _Proc:
    """One role process and its output lines (read on a thread)."""

    def __init__(self, role: str, proc: subprocess.Popen[str]) -> None:
        self.role, self.proc = role, proc
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_line(self, word: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(word in line for line in self.lines):
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.05)
        return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def _spawn(wan: Testbed | None, role: str, cfg: dict[str, Any], env: dict[str, str]) -> _Proc:
    argv = [*_PEER, role, json.dumps(cfg)]
    kw: dict[str, Any] = dict(env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    host = {"prefill": "p", "probe": "p", "relay": "rld", "main": "md"}[role]
    proc = wan[host].spawn(argv, **kw) if wan is not None else subprocess.Popen(argv, **kw)
    return _Proc(role, proc)


def _inject(fault: str, wan: Testbed | None, procs: dict[str, _Proc]) -> str:
    """Apply one fault; returns what was done (for the log)."""
    if fault == "link_down":
        if wan is not None and wan.forwarder_pid is not None:
            os.kill(wan.forwarder_pid, signal.SIGSTOP)
            try:
                time.sleep(K_LINK_DOWN_S)
            finally:
                os.kill(wan.forwarder_pid, signal.SIGCONT)
            return "WAN forwarder paused 2 s"
        procs["main"].proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(K_LINK_DOWN_S)
        finally:
            procs["main"].proc.send_signal(signal.SIGCONT)
        return "MD stopped 2 s (loopback: no link to take down)"
    if fault == "stream_reset":
        if wan is None:
            return "skipped: stream resets need the emulated WAN"
        res = wan.p.run(["ss", "-K", "dst", wan.md.addr], check=False)
        return f"ss -K dst {wan.md.addr}: rc {res.returncode} {res.stderr.strip()[:80]}"
    if fault in _KILLED:
        role = _KILLED[fault]
        procs[role].kill()
        return f"kill -9 {role} (pid {procs[role].proc.pid})"
    if fault == "burst_loss":  # set up with the link, for the whole episode
        return "Gilbert-Elliott loss p=0.02 r=0.25 all along" if wan else "skipped: no WAN"
    return "no fault"


def run_episode(
    fault: str,
    *,
    seed: int = 1,
    duration_s: float = 6.0,
    concurrency: int = 3,
    loopback: bool = False,
    fault_at: tuple[float, float] = (1.0, 3.0),
    routes: tuple[str, ...] = K_ROUTES,
    request_timeout_s: float = 15.0,
    rss_every_s: float | None = None,
) -> dict[str, Any]:
    """Run one episode with ``fault``; returns the raw records and accounting.

    Args:
        fault: one of :data:`FAULTS`, or ``"mixed"``: a random survivable fault
            (:data:`K_SURVIVABLE`) every 5-15 s for the whole episode.
        seed: drives the workload and the moment of the fault.
        duration_s: seconds of traffic.
        concurrency: requests in flight at once.
        loopback: run on loopback even where the emulated WAN is available.
        fault_at: the fault strikes this many seconds (uniform) after traffic starts.
        routes: the routes requests draw from (``auto``, ``p-md``, ``p-rld-md``).
        request_timeout_s: each request's deadline.
        rss_every_s: sample the roles' resident memory this often (None: don't).

    Returns:
        ``{"fault", "link", "injected", "requests", "p", "decoders",
        "decoders_start", "crashed", "log", "wall_s"}``; ``requests`` comes
        from P's journal (:func:`journal_requests`), so a killed P's requests
        are there too; ``p`` is None when P was killed.

    Raises:
        RuntimeError: if P did not start.
        subprocess.TimeoutExpired: if P (or the probe) overran every bound.
    """
    t0 = time.monotonic()
    rng = random.Random(seed)
    env = {**os.environ, "PDDNET_SECRET": secrets.token_hex(32)}
    with tempfile.TemporaryDirectory() as tmp, _link(fault, loopback, seed) as wan:
        cfg = base_config(seed, duration_s, concurrency, routes, request_timeout_s)
        cfg["out"] = str(Path(tmp) / "episode.json")
        cfg["journal"] = str(Path(tmp) / "requests.jsonl")
        cfg["rss_every_s"] = rss_every_s
        if wan is not None:
            hosts = {"prefill": wan.p.addr, "relay": wan.rld.addr, "main": wan.md.addr}
            ports = {"prefill": 5560, "relay": 5561, "main": 5562}
        else:
            hosts = dict.fromkeys(_ROLES, "127.0.0.1")
            ports = {r: _free_port() for r in _ROLES}
        if wan is not None:
            # UCX's default "tcp,sm,self" picks shared memory between P and RLD (one
            # kernel), which stalls silently across network namespaces; see
            # docs/reliability.md. Each host is its own machine here: TCP only.
            env.setdefault("UCX_TLS", "tcp")
        cfg["hosts"] = hosts
        cfg["control"] = {r: f"tcp://{hosts[r]}:{ports[r]}" for r in _ROLES}
        procs: dict[str, _Proc] = {}
        injected = "not reached"
        try:
            for role in _ROLES:
                procs[role] = _spawn(wan, role, cfg, env)
            if not procs["prefill"].wait_line("p: running", 60):
                raise RuntimeError("P did not start:\n" + "\n".join(procs["prefill"].lines[-20:]))
            if fault == "mixed":
                done: list[str] = []
                end = time.monotonic() + duration_s - K_LONG_FAULT_EVERY_S[0]
                while time.monotonic() + K_LONG_FAULT_EVERY_S[0] < end:
                    time.sleep(rng.uniform(*K_LONG_FAULT_EVERY_S))
                    done.append(_inject(rng.choice(K_SURVIVABLE), wan, procs).split(":")[0])
                injected = f"{len(done)} faults: " + ", ".join(
                    f"{done.count(k)} x {k}" for k in sorted(set(done))
                )
            else:
                time.sleep(rng.uniform(*fault_at))
                injected = _inject(fault, wan, procs)
            if fault == "kill_p":
                cfg["out"] = str(Path(tmp) / "probe.json")
                probe = _spawn(wan, "probe", cfg, env)
                probe.proc.wait(timeout=cfg["settle_s"] + 30)
                procs["probe"] = probe
            else:
                bound = duration_s + cfg["request_timeout_s"] + 2 * cfg["lease_s"] + 40
                procs["prefill"].proc.wait(timeout=bound + cfg["settle_s"])
            data = json.loads(Path(cfg["out"]).read_text())
            journal = Path(cfg["journal"]).read_text() if Path(cfg["journal"]).exists() else ""
            data["requests"] = journal_requests(journal, p_killed=fault == "kill_p")
            # a process that died although no fault killed it crashed
            killed = _KILLED.get(fault)
            crashed = [
                f"{r} (exit {p.proc.returncode})"
                for r, p in procs.items()
                if r in ("relay", "main") and r != killed and p.proc.poll() is not None
            ]
        finally:
            for p in procs.values():
                p.kill()
        log = [f"[{r}] {line}" for r, p in procs.items() for line in p.lines[-40:]]
    return {
        "fault": fault,
        "link": f"emulated WAN ({wan.backend})" if wan is not None else "loopback",
        "injected": injected,
        "log": log,
        "wall_s": time.monotonic() - t0,
        "crashed": crashed,
        **data,
    }


def journal_requests(text: str, *, p_killed: bool) -> list[dict[str, Any]]:
    """The requests of P's journal (JSON lines; a request's last line wins).

    A request without an outcome was still in flight when P stopped writing:
    with ``p_killed`` (the fault killed P, and the user it hosts) its outcome
    becomes :data:`K_KILLED_WITH_P`; otherwise it stays None (lost). A last
    line cut short by the kill is skipped: that request's earlier line holds.

    Raises:
        ValueError: a malformed line other than a cut-short last one.
    """
    recs: dict[int, dict[str, Any]] = {}
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1 and p_killed:  # no newline after it: the kill cut it
                continue
            raise ValueError(f"P's journal, line {i + 1}: {exc}: {line[:80]!r}") from exc
        recs[rec["request_id"]] = rec
    out = list(recs.values())
    if p_killed:
        out = [r if r["outcome"] else {**r, "outcome": K_KILLED_WITH_P} for r in out]
    return out


_REF_MODEL: list[ReferenceModel] = []


def reference(prompt: list[int], n: int) -> list[int]:
    """Single-instance greedy decoding of ``prompt`` for ``n`` tokens."""
    if not _REF_MODEL:
        _REF_MODEL.append(ReferenceModel.create(TINY, num_blocks=512))
    model = _REF_MODEL[0]
    seq = model.new_sequence()
    model.reserve(seq, len(prompt) + n)
    tok = greedy(model.prefill(seq, prompt))
    out = [tok]
    while len(out) < n:
        tok = greedy(model.decode_step(seq, tok))
        out.append(tok)
    model.release(seq)
    return out


_LISTS = ("errors", "error_examples", "unaccounted", "unreachable", "bad_requests")  # not row cells


def check_episode(ep: dict[str, Any]) -> dict[str, Any]:
    """Classify an episode's requests and block accounting.

    Returns:
        counts: ``requests``, ``completed``, ``typed_errors`` (``killed_with_p``
        of them were in flight when the fault killed P and the user it hosts),
        ``lost``, ``hung`` (hung requests, plus every request a surviving decoder
        still serves after settling, plus every surviving decoder that does not
        answer the probe: those are listed in ``unreachable``), ``corrupted``,
        ``leaked_blocks``, ``unaccounted`` (the accounting a killed process took
        with it) and ``errors`` (distinct reasons).
    """
    out: dict[str, Any] = dict.fromkeys(
        ("requests", "completed", "typed_errors", "lost", "hung", "corrupted", "leaked_blocks"), 0
    )
    out.update(
        wrong_token=0, duplicate_position=0, missing_position=0, hung_error_at_p=0, killed_with_p=0
    )
    out["bad_requests"] = []
    reasons: dict[str, int] = {}
    examples: list[str] = []  # a few typed errors in full, for the report
    for rec in ep["requests"]:
        out["requests"] += 1
        ref = reference(rec["prompt"], rec["max_tokens"])
        positions = [t[0] for t in rec["tokens"]]
        dup = len(set(positions)) != len(positions)
        wrong = any(pos >= len(ref) or ref[pos] != tok for pos, tok in rec["tokens"])
        holes = rec["outcome"] == "finished" and sorted(set(positions)) != list(
            range(rec["max_tokens"])
        )
        out["wrong_token"] += int(wrong)
        out["duplicate_position"] += int(dup)
        out["missing_position"] += int(holes)
        bad = dup or wrong or holes
        if rec["outcome"] == "finished":
            out["completed"] += 1
        elif rec["outcome"] == "error":
            out["typed_errors"] += 1
            key = (rec["error"] or "?").split(":")[0]
            reasons[key] = reasons.get(key, 0) + 1
            if len(examples) < 5:
                examples.append(f"{rec['route']}: {rec['error']}"[:400])
        elif rec["outcome"] == K_KILLED_WITH_P:
            # its user died with P: nobody can read it; the decoders must let it go
            out["typed_errors"] += 1
            out["killed_with_p"] += 1
            reasons["killed with P"] = reasons.get("killed with P", 0) + 1
        elif rec["outcome"] == "hung":
            out["hung"] += 1
            out["hung_error_at_p"] += int(bool(rec.get("error_at_p")))
        else:
            out["lost"] += 1
        out["corrupted"] += int(bad)
        if bad or rec["outcome"] in ("hung", None):
            # keep the evidence (the reference too) for the report
            out["bad_requests"].append({**rec, "reference": ref})
    unaccounted = []
    unreachable = []
    p = ep.get("p")
    if p is not None:
        out["leaked_blocks"] += p["held_blocks"] + (p["baseline_free_blocks"] - p["free_blocks"])
    else:
        unaccounted.append("p (killed)")
    killed = _KILLED.get(ep["fault"])
    for role, doc in (ep.get("decoders") or {}).items():
        if doc is None and role == killed:
            unaccounted.append(f"{role} (killed)")
            continue
        if doc is None:  # a survivor that stopped answering: whatever it holds is stuck
            unreachable.append(role)
            out["hung"] += 1
            continue
        out["leaked_blocks"] += doc["num_blocks"] - doc["free_blocks"] - doc["cache_blocks"]
        out["hung"] += doc["active"]  # a decoder still working on a request after settling
    out["crashed"] = len(ep.get("crashed", []))
    out["unaccounted"] = unaccounted
    out["unreachable"] = unreachable
    out["errors"] = reasons
    out["error_examples"] = examples
    # a stream the sink ended at its deadline is typed, but may hide a stuck decoder
    out["deadline_timeouts"] = reasons.get("TransferTimeout", 0)
    growth = [p["rss_growth_kb"]] if p is not None else []
    for role, doc in (ep.get("decoders") or {}).items():
        first = (ep.get("decoders_start") or {}).get(role)
        if doc is not None and first is not None:
            growth.append(doc["rss_kb"] - first["rss_kb"])
    out["rss_growth_kb"] = max(growth, default=0)
    sink = ep.get("sink") or {}
    out["sink_rounds"] = sink.get("rounds", 0)  # the sink asked decoders to re-send
    out["sink_duplicates"] = sink.get("duplicates", 0)
    return out


# the episodes' counts the summary adds up, and those a passing run has at 0
K_SUMMED = (
    "requests",
    "completed",
    "typed_errors",
    "lost",
    "hung",
    "hung_error_at_p",
    "killed_with_p",
    "corrupted",
    "wrong_token",
    "missing_position",
    "duplicate_position",
    "leaked_blocks",
    "crashed",
    "deadline_timeouts",
    "sink_rounds",
    "sink_duplicates",
)
K_MUST_BE_ZERO = ("lost", "hung", "corrupted", "leaked_blocks", "crashed")


def totals(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's counts: :data:`K_SUMMED` over the episodes' :func:`check_episode`
    results, ``episodes``, and ``unreachable_survivors`` (surviving decoders that
    did not answer the probe; each is also in ``hung``)."""
    out: dict[str, Any] = {k: sum(r[k] for r in results) for k in K_SUMMED}
    out["episodes"] = len(results)
    out["unreachable_survivors"] = sum(len(r["unreachable"]) for r in results)
    return out


def passed(summary: dict[str, Any], failures: list[str]) -> bool:
    """Whether a run passes: every episode ran, and :data:`K_MUST_BE_ZERO` are all 0."""
    return not failures and all(summary[k] == 0 for k in K_MUST_BE_ZERO)


def second_half_growth(samples: list[dict[str, Any]]) -> dict[str, int | None]:
    """Each role's resident-memory growth (KiB) from the middle sample to the last:
    start-up and warm-up are over by then, so steady growth is a leak."""
    if len(samples) < 3:
        return {}
    mid, last = samples[len(samples) // 2], samples[-1]
    out: dict[str, int | None] = {}
    for role in ("prefill", "relay", "main"):
        a, b = mid.get(role), last.get(role)
        out[role] = None if a is None or b is None else int(b - a)
    return out


def _plan(args: argparse.Namespace, faults: list[str]) -> list[str]:
    """quick: each fault once; soak: every fault once, then random ones."""
    if args.quick:
        return list(faults)
    rng = random.Random(args.seed)
    return [*faults, *(rng.choice(faults) for _ in range(100_000))]


def missing_peers(no_wan: str | None, faults: Iterable[str]) -> dict[str, str]:
    """What the run lacks to inject ``faults`` as asked, and how to get it.

    Args:
        no_wan: why there is no emulated WAN (``unavailable_reason()``), or None.
        faults: the faults asked for.
    """
    if no_wan is not None:
        return {
            "emulated WAN": f"{no_wan}: the episodes run on loopback (no link to take down, "
            f"no bursty loss, no stream resets); {K_EMU_HOW}"
        }
    if "stream_reset" in faults and shutil.which("ss") is None:
        return {
            "ss": "ss not found on PATH: the stream_reset episodes are not run; install "
            "iproute2 (Debian/Ubuntu: apt-get install iproute2; Fedora: dnf install iproute)"
        }
    return {}


def main(args: argparse.Namespace) -> int:
    faults = [f for f in args.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        print(f"unknown faults: {sorted(unknown)}; choose from {FAULTS}")
        return 2
    total = args.duration if args.duration is not None else (50.0 if args.quick else 120.0)
    episode_s = 3.0 if args.quick else args.episode
    deadline_s = args.deadline if args.deadline else (8.0 if args.quick else 15.0)
    plan = _plan(args, faults)
    if args.long_lived:  # one episode filling the time (minus settling), faults within
        plan, episode_s, args.parallel = ["mixed"], max(20.0, total - 45.0), 1
    reason = None
    if not args.loopback:
        reason = unavailable_reason()  # probe once, before the threads race on it
        if reason is None:
            netem_available()  # the same: its probe namespace has a fixed name
        else:
            print(f"pddnet bench faults: no emulated WAN ({reason}); running on loopback")
    missing = missing_peers(reason, faults)
    if "ss" in missing:
        plan = [f for f in plan if f != "stream_reset"]
    t0 = time.monotonic()
    rss0 = rss_kb(os.getpid())
    results: list[tuple[int, str, dict[str, Any]]] = []
    failures: list[str] = []
    lock = threading.Lock()
    next_i = [0]

    def worker() -> None:
        while True:
            with lock:
                i = next_i[0]
                # start an episode only if it can finish within the total time
                if i >= len(plan) or (
                    not args.quick and time.monotonic() - t0 + episode_s + 5 > total
                ):
                    return
                next_i[0] += 1
            fault = plan[i]
            try:
                ep = _episode(i, fault)
            except Exception as exc:  # an episode that could not run is reported, not hidden
                with lock:
                    failures.append(f"episode {i} ({fault}): {type(exc).__name__}: {exc}")
                    print(f"  episode {i} {fault:<12} FAILED TO RUN: {exc}", flush=True)
                continue
            res = check_episode(ep)
            with lock:
                results.append((i, fault, {**ep, "result": res}))
                print(
                    f"  episode {i} {fault:<12} {res['completed']:>3} ok "
                    f"{res['typed_errors']:>3} err {res['hung']} hung {res['lost']} lost "
                    f"{res['corrupted']} corrupt {res['leaked_blocks']} leaked "
                    f"({ep['injected']}; {ep['link']}; {ep['wall_s']:.0f}s)",
                    flush=True,
                )

    def _episode(i: int, fault: str) -> dict[str, Any]:
        return run_episode(
            fault,
            seed=args.seed * 1000 + i,
            duration_s=episode_s,
            concurrency=args.concurrency,
            loopback=args.loopback,
            fault_at=(0.5, max(0.6, episode_s / 2)),
            routes=tuple(args.routes.split(",")),
            request_timeout_s=deadline_s,
            rss_every_s=10.0 if args.long_lived else None,
        )

    threads = [threading.Thread(target=worker) for _ in range(max(1, args.parallel))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.sort(key=lambda r: r[0])
    rows = []
    for i, fault, ep in results:
        res = ep["result"]
        rows.append(
            {
                "episode": i,
                "fault": fault,
                **{k: v for k, v in res.items() if k not in _LISTS},
                "unaccounted": ",".join(res["unaccounted"]) or "-",
                "unreachable": ",".join(res["unreachable"]) or "-",
                "wall_s": round(ep["wall_s"], 1),
            }
        )
    summary: dict[str, Any] = totals([ep["result"] for _, _, ep in results])
    summary.update(
        rss_growth=1024 * max((r["rss_growth_kb"] for r in rows), default=0),
        bench_rss_growth=1024 * (rss_kb(os.getpid()) - rss0),
        request_deadline_s=deadline_s,
        elapsed_s=time.monotonic() - t0,
        link=results[0][2]["link"] if results else "-",
        faults_seen=sorted({f for _, f, _ in results}),
        episodes_failed_to_run=failures,
    )
    if missing:
        summary["missing_peers"] = missing
    if args.long_lived and results:
        summary["rss_growth_second_half_kb"] = second_half_growth(results[0][2]["rss_samples"])
    print_table(rows, title="\nfault episodes")
    print_table(
        [{"metric": k, "value": v} for k, v in summary.items() if k != "missing_peers"],
        title="summary",
    )
    print_missing(missing)
    episodes = [
        {k: v for k, v in ep.items() if k != "requests"} | {"episode": i} for i, _, ep in results
    ]
    write_report(args.json, summary, episodes=episodes, rows=rows)
    return 0 if passed(summary, failures) else 1
