"""A cluster of OS processes with a real etcd: P, 2 RLD and 2 MD, each in its
own network namespace where root (all joined by one bridge; on loopback
otherwise), every instance registered under a 2 s lease (tests/cluster_node.py).

One scenario, on one etcd and one cluster (each step needs the state the one
before left):

1. a session's later turn goes to the MD that holds its prefix (P->MD, 12 of
   its 14 blocks cached there), and the first turns spread over both relays;
2. an MD killed with SIGKILL leaves P within the lease's TTL plus etcd's
   expiry check; the request it was to take over finishes at its relay; new
   requests, a later turn of one of its sessions too, go to the other MD;
3. the MD restarts under its name as a new process with a new address: it
   receives traffic again and nothing of the old one carries over (P's mirror
   of it is empty, it holds no prefix, the request to it is served whole);
   the other MD (a 10 s lease) is killed and restarted at once, so P sees
   its new address as an update, not a leave: P's control connection moves
   to the new process, which serves the next request;
4. an RLD killed with two requests, one it decodes and one whose KV it never
   got: both finish through their MD (the sink's takeover, docs/reliability.md,
   fault table), the RLD leaves P within the TTL, new requests go to the
   other relay;

and through all of it no request is lost (each ends with the reference
tokens, its blocks came back), and at the end no block is held or leaked on
any side and P's control connections go only to the decoders still there.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pddnet.demo import reference_streams
from pddnet.emu._netns import enter_netns, ip, kill_pids, netns_delete, netns_pids, remove_stale
from pddnet.emu._netns import unavailable_reason as netns_unavailable
from pddnet.recompute import TINY

sys.path.insert(0, str(Path(__file__).parent))
from cluster_node import TTL

NODE = str(Path(__file__).parent / "cluster_node.py")
HOSTS = ("p", "rld0", "rld1", "md0", "md1", "md1-again", "md0-again")
K_LONG_LEASE_S = 10  # md0's: it restarts well before its lease runs out
K_LEAVE_S = TTL + 1.5  # the lease's TTL, etcd's 0.5 s expiry check, the watch, CI load


class _Hosts:
    """One network namespace per instance on a bridge (root), else loopback."""

    def __init__(self) -> None:
        self.run = f"pddc-{os.getpid()}-{os.urandom(2).hex()}"
        self.netns = netns_unavailable() is None
        self.addr = {
            h: f"10.97.0.{10 + i}" if self.netns else "127.0.0.1" for i, h in enumerate(HOSTS)
        }
        self.procs: list[subprocess.Popen[str]] = []
        self.made: list[str] = []
        if not self.netns:
            return
        remove_stale("pddc")  # a killed run's namespaces
        hub = self._ns("hub")
        ip("link", "add", "br0", "type", "bridge", ns=hub)
        ip("link", "set", "br0", "up", ns=hub)
        for i, h in enumerate(HOSTS):
            ns = self._ns(h)
            ip("link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns, ns=hub)
            ip("link", "set", f"v{i}", "master", "br0", "up", ns=hub)
            ip("addr", "add", f"{self.addr[h]}/24", "dev", "eth0", ns=ns)
            ip("link", "set", "eth0", "up", ns=ns)
            ip("link", "set", "lo", "up", ns=ns)

    def _ns(self, host: str) -> str:
        name = f"{self.run}-{host}"
        ip("netns", "add", name)
        self.made.append(name)
        return name

    def spawn(self, host: str, *args: str, **kw: Any) -> subprocess.Popen[str]:
        prefix = ["ip", "netns", "exec", f"{self.run}-{host}"] if self.netns else []
        proc = subprocess.Popen([*prefix, sys.executable, NODE, *args], text=True, **kw)
        self.procs.append(proc)
        return proc

    @contextlib.contextmanager
    def inside(self, host: str) -> Iterator[None]:
        if not self.netns:
            yield
            return
        with enter_netns(f"{self.run}-{host}"):
            yield

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for ns in self.made:
            kill_pids(netns_pids(ns))
            netns_delete(ns)
        self.procs, self.made = [], []


class _P:
    """The P process: one JSON command a line, one JSON answer a line."""

    def __init__(self, hosts: _Hosts, url: str) -> None:
        self.proc = hosts.spawn(
            "p", "prefill", url, hosts.addr["p"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert self._line(60) == {"ready": True}

    def _line(self, timeout: float) -> Any:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"P did not answer within {timeout:g} s"
        line = self.proc.stdout.readline()
        assert line, f"P exited {self.proc.wait()}"
        return json.loads(line)

    def __call__(self, op: str, timeout: float = 60.0, **kw: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        reply = self._line(timeout)
        assert "error" not in reply, reply["error"]
        return reply["ok"]


@pytest.fixture
def hosts() -> Iterator[_Hosts]:
    h = _Hosts()
    try:
        yield h
    finally:
        h.close()


def _leaked(doc: dict[str, Any] | None) -> tuple[int, int] | None:
    """A decoder's requests in progress and blocks neither free nor cached."""
    if doc is None:
        return None
    return doc["active"], doc["num_blocks"] - doc["free_blocks"] - doc["cache_blocks"]


def _check(results: list[dict[str, Any]], ref: dict[int, list[int]]) -> None:
    """Each request ended with the reference tokens, and its blocks came back."""
    for r in results:
        assert r["done"] and r["error"] is None, json.dumps(r)  # whole: sources too
        assert r["tokens"] == ref[r["rid"]], f"request {r['rid']}'s tokens differ from greedy"
        assert r["released"], r


def test_a_cluster_of_processes_routes_by_prefix_and_load_and_survives_kills(
    hosts: _Hosts,
) -> None:
    from etcd_server import start_etcd

    with hosts.inside("p"):  # etcd runs beside P, on P's address
        etcd = start_etcd(hosts.addr["p"])
    try:
        _scenario(hosts, etcd.url)
    finally:
        hosts.close()  # the instances first: they revoke their leases
        etcd.close()


def _scenario(hosts: _Hosts, url: str) -> None:
    rng = np.random.default_rng(21)
    records: list[dict[str, Any]] = []
    rids = iter(range(1, 1000))

    def req(session: int, prompt: list[int], max_tokens: int = 16, **kw: Any) -> dict[str, Any]:
        prompt = list(prompt)  # the caller's list grows by the next turn
        turn = sum(r["session"] == session for r in records)
        rec = {"request_id": next(rids), "phase": "c", "session": session, "turn": turn}
        records.append({**rec, "prompt": prompt, "max_tokens": max_tokens})
        return {"rid": rec["request_id"], "session": session, "prompt": prompt,
                "max_tokens": max_tokens, **kw}  # fmt: skip

    def ref() -> dict[int, list[int]]:
        return reference_streams(records)

    def cold() -> list[int]:
        return rng.integers(0, TINY.vocab_size, 200).tolist()

    p = _P(hosts, url)
    decoders = {}
    for name in ("rld0", "rld1", "md0", "md1"):
        role = "relay" if name.startswith("rld") else "main"
        lease = str(K_LONG_LEASE_S if name == "md0" else TTL)
        decoders[name] = hosts.spawn(name, role, name, url, hosts.addr[name], lease)
    p("wait", present=list(decoders), absent=[], within=60)

    # 1. the first turns spread over both relays; each later turn goes P->MD
    # to the MD that served its first turn, which holds 12 of its 14 blocks
    prompts = {s: cold() for s in range(4)}
    firsts = p("run", requests=[req(s, prompts[s]) for s in range(4)])
    assert [r["route"] for r in firsts] == ["P_RLD_MD"] * 4
    assert Counter(r["relay"] for r in firsts) == {"rld0": 2, "rld1": 2}
    for s, r in enumerate(firsts):  # MD caches a prompt when its request ends
        deadline = time.monotonic() + 10
        while p("predict", main=r["main"], prompt=prompts[s])["blocks"] < 12:
            assert time.monotonic() < deadline, f"session {s}'s prompt never cached"
            time.sleep(0.02)
    for s in range(4):
        prompts[s] += rng.integers(0, TINY.vocab_size, 20).tolist()
    laters = p("run", requests=[req(s, prompts[s]) for s in range(4)])
    for first, later in zip(firsts, laters, strict=True):
        assert (later["main"], later["hit"], later["route"]) == (first["main"], 12, "P_MD")
    _check(firsts + laters, ref())

    # 2. md1 dies with a request on its way to it (RLD decodes, MD's KV held):
    # md1 leaves P within the TTL, that request ends at its relay, new
    # requests (one of md1's sessions among them) go to md0
    on_md1 = next(s for s, r in enumerate(firsts) if r["main"] == "md1")
    held = p("hold", request=req(10, cold(), 120, relay="rld0", main="md1"), eager=3)
    decoders.pop("md1").send_signal(signal.SIGKILL)
    killed = time.monotonic()
    p("wait", present=[], absent=["md1"], within=K_LEAVE_S + 5)
    left_s = time.monotonic() - killed
    print(f"md1 left P {left_s:.2f} s after its kill")
    assert left_s <= K_LEAVE_S, f"md1 left P {left_s:.2f} s after its kill"
    prompts[on_md1] += rng.integers(0, TINY.vocab_size, 20).tolist()
    after = p("run", requests=[req(on_md1, prompts[on_md1]), req(11, cold())])
    assert [r["main"] for r in after] == ["md0", "md0"]
    ended = p("result", rid=held["rid"])
    assert set(ended["sources"]) == {"rld0"}  # RLD decoded it to the end, alone
    _check([*after, ended], ref())

    # 3. md1 comes back under its name: a new process on a new address. It
    # gets traffic again, and holds nothing of the old one's cache
    decoders["md1"] = hosts.spawn("md1-again", "main", "md1", url, hosts.addr["md1-again"])
    p("wait", present=["md1"], absent=[], within=60)
    assert p("predict", main="md1", prompt=prompts[on_md1])["blocks"] == 0
    prompts[on_md1] += rng.integers(0, TINY.vocab_size, 20).tolist()
    again = p("run", requests=[req(on_md1, prompts[on_md1], main="md1")])
    assert again[0]["hit"] == 0  # the new md1 received the whole prompt
    again += p("run", requests=[req(12, cold()), req(13, cold())])
    assert {r["main"] for r in again[1:]} == {"md0", "md1"}  # load spreads to it again
    _check(again, ref())

    # md0 restarts at once on a new address, long before its old lease runs
    # out: P sees an update of md0, not a leave, and must still take it for
    # the new process it is (the old one's address is dead)
    old_md0 = p("controls")["md0"]
    decoders.pop("md0").send_signal(signal.SIGKILL)
    decoders["md0"] = hosts.spawn("md0-again", "main", "md0", url, hosts.addr["md0-again"])
    deadline = time.monotonic() + 60
    while p("controls").get("md0", old_md0) == old_md0:
        assert time.monotonic() < deadline, "P never took the new md0"
        time.sleep(0.02)
    p("wait", present=["md0"], absent=[], within=60)
    prompts[on_md1] += rng.integers(0, TINY.vocab_size, 20).tolist()
    again = p("run", requests=[req(on_md1, prompts[on_md1], main="md0")])
    assert again[0]["hit"] == 0
    _check(again, ref())

    # 4. rld0 dies with two requests (their MD's KV held back until then):
    # one it decodes, one whose KV it never got. Both finish through MD
    # (the sink's takeover), rld0 leaves P within the TTL, and new requests
    # go to rld1
    held = [
        p("hold", request=req(20, cold(), 64, relay="rld0"), eager=3),
        p("hold", request=req(21, cold(), 64, relay="rld0"), eager=0),
    ]
    decoders.pop("rld0").send_signal(signal.SIGKILL)
    killed = time.monotonic()
    for h in held:
        p("release", rid=h["rid"])
    p("wait", present=[], absent=["rld0"], within=K_LEAVE_S + 5)
    left_s = time.monotonic() - killed
    print(f"rld0 left P {left_s:.2f} s after its kill")
    assert left_s <= K_LEAVE_S, f"rld0 left P {left_s:.2f} s after its kill"
    ended = [p("result", rid=h["rid"]) for h in held]
    assert ended[0]["sources"].count("rld0") >= 3, ended[0]["sources"]
    assert "rld0" not in ended[1]["sources"], ended[1]["sources"]
    for h, e in zip(held, ended, strict=True):
        assert h["main"] in e["sources"], e["sources"]  # MD took over
    after = p("run", requests=[req(22, cold()), req(23, cold())])
    assert [r["relay"] for r in after] == ["rld1", "rld1"]
    _check([*ended, *after], ref())

    # nothing held or leaked anywhere; P talks only to the decoders still there
    deadline = time.monotonic() + 15
    while True:
        stats = p("stats")
        leaked = {name: _leaked(doc) for name, doc in stats["probes"].items()}
        if set(leaked.values()) == {(0, 0)} or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sorted(stats["roles"]) == ["md0", "md1", "rld1"]
    assert leaked == dict.fromkeys(["md0", "md1", "rld1"], (0, 0)), leaked
    assert (stats["held_blocks"], stats["active_relays"], stats["by_relay"]) == (0, 0, {})
    assert stats["control_peers"] == ["md0", "md1", "rld1"]
    assert "rld0" not in stats["links"]
