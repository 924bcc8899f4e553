"""The ``pdd`` testbed: five network namespaces and an emulated WAN between them.

Layout (names get a unique per-run prefix ``PREFIX-PID-RUN-``)::

    dc-a-p  (10.99.1.2) --+                                        +-- dc-b-md (10.99.2.2)
                          br0 [ra] == shaped WAN == [rb] ----------+
    dc-a-rld(10.99.1.3) --+  10.99.0.1          10.99.0.2

``ra`` and ``rb`` are router namespaces. ``dc-a-p`` and ``dc-a-rld`` share a
bridge in ``ra`` (the fast, unshaped DC-A link); every packet between DC-A and
DC-B crosses the WAN between ``ra`` and ``rb``. The WAN is a veth pair with
netem on both ends when the kernel has ``sch_netem``, and otherwise a TUN device
in each router joined by the user-space forwarder (:mod:`pddnet.emu._forwarder`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import TransportError
from ._netns import (
    NETNS_DIR,
    enter_netns,
    ip,
    kill_pids,
    list_netns,
    netns_delete,
    ns_exec,
    pid_alive,
    unavailable_reason,
)
from ._spec import LinkSpec, WanSpec

__all__ = [
    "HOSTS",
    "Host",
    "Testbed",
    "emulated_wan",
    "netem_available",
    "remove_stale_workdirs",
]

HOSTS = ("dc-a-p", "dc-a-rld", "dc-b-md")
_ALIASES = {"p": "dc-a-p", "rld": "dc-a-rld", "md": "dc-b-md"}
_ADDR = {"dc-a-p": "10.99.1.2", "dc-a-rld": "10.99.1.3", "dc-b-md": "10.99.2.2"}
_ROLE = {"dc-a-p": "p", "dc-a-rld": "rld", "dc-b-md": "md"}
_WAN_A, _WAN_B = "10.99.0.1", "10.99.0.2"
_WAN_DEV = "wan"

_netem: bool | None = None


def netem_available() -> bool:
    """Whether ``tc qdisc add ... netem`` works here (probed once in a scratch namespace)."""
    global _netem
    if _netem is None:
        name = f"pddprobe-{os.getpid()}-netem"
        ip("netns", "add", name)
        try:
            res = subprocess.run(
                ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem"],
                capture_output=True,
            )
            _netem = res.returncode == 0
        finally:
            ip("netns", "delete", name, check=False)
    return _netem


@dataclass
class Host:
    """A host of the testbed: a network namespace with one address.

    Attributes:
        name: the host's role name (``dc-a-p``, ``dc-a-rld``, ``dc-b-md``).
        netns: the namespace's (run-unique) name.
        addr: the host's IPv4 address; reachable from every other host.
    """

    name: str
    netns: str
    addr: str
    _testbed: Testbed | None = None

    def spawn(self, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this host's namespace.

        The testbed tracks the process and kills it (by PID) on teardown.

        Args:
            argv: the command.
            **popen_kwargs: passed to :class:`subprocess.Popen` (stdout, env, ...).

        Returns:
            The Popen handle.
        """
        proc = self._popen(["ip", "netns", "exec", self.netns, *argv], **popen_kwargs)
        if self._testbed is not None:
            self._testbed._procs.append(proc)
        return proc

    def _popen(self, argv: list[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on the testbed's host CPUs (:attr:`Testbed.host_cpus`)."""
        cpus = self._testbed.host_cpus if self._testbed is not None else None
        with _thread_affinity(cpus):
            return subprocess.Popen(argv, **popen_kwargs)

    def _wait(
        self, argv: list[str], input: bytes | None, timeout: float | None, **popen_kwargs: Any
    ) -> tuple[int, Any, Any]:
        """``subprocess.run`` through :meth:`_popen`: (returncode, stdout, stderr).

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout`` (it is killed).
        """
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stdin = subprocess.PIPE if input is not None else subprocess.DEVNULL
        with self._popen(argv, stdin=stdin, **pipes, **popen_kwargs) as proc:
            try:
                out, err = proc.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
        return proc.returncode, out, err

    def run(
        self, argv: Sequence[str], *, timeout: float | None = 60.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside this host's namespace and wait for it.

        Returns:
            The completed process (text stdout/stderr captured).

        Raises:
            TransportError: it exited non-zero and ``check`` is set.
            subprocess.TimeoutExpired: it ran past ``timeout`` (it is killed).
        """
        full = ["ip", "netns", "exec", self.netns, *argv]
        code, out, err = self._wait(full, None, timeout, text=True)
        res = subprocess.CompletedProcess(full, code, out, err)
        if check and res.returncode != 0:
            raise TransportError(
                f"{argv!r} on {self.name} exited {res.returncode}: {res.stderr.strip()[-500:]}",
                peer=self.name,
            )
        return res

    def call(
        self, func: Callable[..., Any], *args: Any, timeout: float | None = 60.0, **kwargs: Any
    ) -> Any:
        """Run ``func(*args, **kwargs)`` in a fresh Python process inside this host.

        ``func`` must be importable by module and qualified name; arguments and
        the result travel by pickle. Use it to run a Python server or client "on"
        a host from benchmark code.

        Returns:
            What ``func`` returned.

        Raises:
            RemoteCallError: ``func`` raised (the message carries its traceback).
        """
        from .._errors import RemoteCallError

        payload = pickle.dumps((func.__module__, func.__qualname__, args, kwargs))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        argv = ["ip", "netns", "exec", self.netns, sys.executable, "-m", "pddnet.emu._call"]
        code, out, err = self._wait(argv, payload, timeout, env=env)
        if code != 0 or not out:
            raise RemoteCallError(
                f"{func.__qualname__} on {self.name}: exit {code}: "
                f"{err.decode(errors='replace')[-2000:]}",
                code="ProcessExit",
                peer=self.name,
            )
        ok, value = pickle.loads(out)
        if not ok:
            code, tb = value
            raise RemoteCallError(
                f"{func.__qualname__} on {self.name} raised:\n{tb}", code=code, peer=self.name
            )
        return value

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Run the body with the calling thread inside this host's namespace.

        Sockets created in the body belong to this host for their whole life, so
        one process (a trio benchmark, say) can hold sockets on several hosts.
        Only the calling thread moves.
        """
        with enter_netns(self.netns):
            yield


class Testbed:
    """An emulated ``pdd`` WAN: build it with :meth:`up`, tear it down with :meth:`down`.

    Args:
        spec: the link parameters.
        backend: ``"auto"`` (netem when the kernel has it, else tun), ``"netem"`` or ``"tun"``.
        prefix: namespace name prefix; names are ``PREFIX-PID-RUN-ROLE``.
        persistent: the forwarder outlives this process (``pddnet wan up``); otherwise
            it exits within 0.25 s of this process dying.
        workdir: where the forwarder's config, stats and log go.
        isolate_cpu: (tun backend, 2 or more CPUs allowed) give the forwarder the
            highest allowed CPU to itself: it runs there and everything the
            hosts start runs on the others (:attr:`host_cpus`). For benchmarks:
            on a kernel without preemption (``PREEMPT_NONE``) a real-time
            forwarder still waits for another task's system call to end, and
            released every round's packets late (docs/wan-emulation.md).

    Use as a context manager (``with Testbed(spec) as tb: ...``) or through
    :func:`emulated_wan`. Teardown kills tracked processes by PID, then every
    process left in the namespaces, then deletes the namespaces; it runs even
    when the body raises or on Ctrl-C.
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(
        self,
        spec: WanSpec,
        *,
        backend: str = "auto",
        prefix: str = "pddt",
        persistent: bool = False,
        workdir: str | None = None,
        isolate_cpu: bool = False,
    ) -> None:
        if backend not in ("auto", "netem", "tun"):
            raise ValueError(f"unknown backend {backend!r}")
        self.spec = spec
        self.requested_backend = backend
        self.backend = backend
        self.run_id = f"{prefix}-{os.getpid()}-{secrets.token_hex(2)}"
        self.persistent = persistent
        self.workdir = workdir or os.path.join(_workdir_base(), self.run_id)
        self.hosts: dict[str, Host] = {
            h: Host(h, f"{self.run_id}-{_ROLE[h]}", _ADDR[h], self) for h in HOSTS
        }
        self.routers = {"a": f"{self.run_id}-ra", "b": f"{self.run_id}-rb"}
        self.isolate_cpu = isolate_cpu
        # set by up() when isolate_cpu applies
        self.forwarder_cpu: int | None = None
        self.host_cpus: frozenset[int] | None = None
        self.forwarder_pid: int | None = None
        self._forwarder: subprocess.Popen[bytes] | None = None
        self._procs: list[subprocess.Popen[Any]] = []
        self._created: list[str] = []

    # -- access -------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Host:
        return self.hosts[_ALIASES.get(name, name)]

    @property
    def p(self) -> Host:
        """The prefill host ``dc-a-p``."""
        return self.hosts["dc-a-p"]

    @property
    def rld(self) -> Host:
        """The relay-decode host ``dc-a-rld``."""
        return self.hosts["dc-a-rld"]

    @property
    def md(self) -> Host:
        """The main-decode host ``dc-b-md`` (across the WAN)."""
        return self.hosts["dc-b-md"]

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this testbed."""
        return [h.netns for h in self.hosts.values()] + list(self.routers.values())

    @property
    def stats_path(self) -> str:
        """The forwarder's JSON stats file."""
        return os.path.join(self.workdir, "forwarder-stats.json")

    # -- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> Testbed:
        """Create namespaces, links and (tun backend) the forwarder.

        Returns:
            self.

        Raises:
            TransportError: a step failed (everything built so far is torn down).
        """
        reason = unavailable_reason()
        if reason:
            raise TransportError(f"cannot build the testbed: {reason}")
        try:
            if self.backend == "auto":
                self.backend = "netem" if netem_available() else "tun"
            if self.backend == "tun" and not os.path.exists("/dev/net/tun"):
                raise TransportError("tun backend needs /dev/net/tun")
            os.makedirs(self.workdir, exist_ok=True)
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        spec = self.spec
        mtu = str(spec.mtu)
        ra, rb = self.routers["a"], self.routers["b"]
        for ns in self.namespaces:
            ip("netns", "add", ns)
            self._created.append(ns)
            ip("link", "set", "lo", "up", ns=ns)
        mem = spec.tcp_mem_max
        host_sysctl = [
            f"net.ipv4.tcp_rmem=4096 131072 {mem}",
            f"net.ipv4.tcp_wmem=4096 16384 {mem}",
            "net.ipv4.tcp_no_metrics_save=1",
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1",
        ]
        router_sysctl = [
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1",
        ]
        if spec.congestion_control:
            # Only the kernel's allowed list may be chosen inside a namespace.
            host_sysctl.append(f"net.ipv4.tcp_congestion_control={spec.congestion_control}")
        for h in self.hosts.values():
            ns_exec(h.netns, ["sysctl", "-q", "-w", *host_sysctl])
        for ns in (ra, rb):
            ns_exec(ns, ["sysctl", "-q", "-w", *router_sysctl])
        # DC-A: bridge in ra, one veth per host.
        ip("link", "add", "br0", "mtu", mtu, "type", "bridge", ns=ra)
        for hname in ("dc-a-p", "dc-a-rld"):
            host = self.hosts[hname]
            port = f"v-{_ROLE[hname]}"
            _veth(port, "eth0", host.netns, mtu, ns=ra)
            ip("link", "set", port, "master", "br0", "up", ns=ra)
            ip("addr", "add", f"{host.addr}/24", "dev", "eth0", ns=host.netns)
            ip("link", "set", "eth0", "up", ns=host.netns)
            ip("route", "add", "default", "via", "10.99.1.1", ns=host.netns)
        ip("addr", "add", "10.99.1.1/24", "dev", "br0", ns=ra)
        ip("link", "set", "br0", "mtu", mtu, "up", ns=ra)
        # DC-B: one veth rb <-> md.
        md = self.md
        _veth("v-md", "eth0", md.netns, mtu, ns=rb)
        ip("addr", "add", "10.99.2.1/24", "dev", "v-md", ns=rb)
        ip("link", "set", "v-md", "up", ns=rb)
        ip("addr", "add", f"{md.addr}/24", "dev", "eth0", ns=md.netns)
        ip("link", "set", "eth0", "up", ns=md.netns)
        ip("route", "add", "default", "via", "10.99.2.1", ns=md.netns)
        # WAN.
        if self.backend == "netem":
            _veth(_WAN_DEV, _WAN_DEV, rb, mtu, ns=ra)
            for ns, mine, link in ((ra, _WAN_A, spec.a_to_b), (rb, _WAN_B, spec.b_to_a)):
                ip("addr", "add", f"{mine}/30", "dev", _WAN_DEV, ns=ns)
                ip("link", "set", _WAN_DEV, "up", ns=ns)
                ns_exec(
                    ns,
                    [
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        _WAN_DEV,
                        "root",
                        "netem",
                        *netem_args(link, spec.mtu, spec.rtt),
                    ],
                )
        else:
            for ns, mine, peer in ((ra, _WAN_A, _WAN_B), (rb, _WAN_B, _WAN_A)):
                ip("tuntap", "add", "dev", _WAN_DEV, "mode", "tun", ns=ns)
                ip("addr", "add", mine, "peer", peer, "dev", _WAN_DEV, ns=ns)
                ip("link", "set", _WAN_DEV, "mtu", mtu, "txqueuelen", "10000", "up", ns=ns)
            self._start_forwarder()
        ip("route", "add", "10.99.2.0/24", "via", _WAN_B, "dev", _WAN_DEV, ns=ra)
        ip("route", "add", "10.99.1.0/24", "via", _WAN_A, "dev", _WAN_DEV, ns=rb)

    def _start_forwarder(self) -> None:
        cfg = {
            "a": {"tun": _WAN_DEV, "netns": os.path.join(NETNS_DIR, self.routers["a"])},
            "b": {"tun": _WAN_DEV, "netns": os.path.join(NETNS_DIR, self.routers["b"])},
            "a_to_b": self.spec.a_to_b.to_dict(),
            "b_to_a": self.spec.b_to_a.to_dict(),
            "rtt": self.spec.rtt,
            "mtu": self.spec.mtu,
            "stats_path": self.stats_path,
            "die_with_parent": not self.persistent,
        }
        allowed = sorted(os.sched_getaffinity(0))
        if self.isolate_cpu and len(allowed) >= 2:
            self.forwarder_cpu = allowed[-1]
            self.host_cpus = frozenset(allowed[:-1])
            cfg["cpus"] = [self.forwarder_cpu]
        cfg_path = os.path.join(self.workdir, "forwarder.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.stats_path)
        log = open(os.path.join(self.workdir, "forwarder.log"), "wb")  # noqa: SIM115
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._forwarder = subprocess.Popen(
            [sys.executable, "-m", "pddnet.emu._forwarder", cfg_path],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=self.persistent,
        )
        log.close()
        self.forwarder_pid = self._forwarder.pid
        deadline = time.monotonic() + 10.0
        while not os.path.exists(self.stats_path):
            if self._forwarder.poll() is not None or time.monotonic() > deadline:
                with open(os.path.join(self.workdir, "forwarder.log")) as f:
                    tail = f.read()[-2000:]
                raise TransportError(f"forwarder failed to start: {tail}")
            time.sleep(0.01)

    def down(self) -> None:
        """Tear everything down: processes by PID, then namespaces. Idempotent."""
        procs, self._procs = self._procs, []
        kill_pids([p.pid for p in procs if p.poll() is None])
        for p in procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=1.0)
        if self.forwarder_pid is not None and _is_forwarder(self.forwarder_pid):
            kill_pids([self.forwarder_pid])
            if self._forwarder is not None:
                with contextlib.suppress(Exception):
                    self._forwarder.wait(timeout=2.0)
            self.forwarder_pid = None
            self._forwarder = None
        existing = set(list_netns())
        for ns in self.namespaces:
            if ns in existing:
                netns_delete(ns)
        self._created.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- observation --------------------------------------------------------------------
    def forwarder_stats(self) -> dict[str, Any] | None:
        """The forwarder's latest stats (tun backend), or ``None``."""
        if self.backend != "tun":
            return None
        try:
            with open(self.stats_path) as f:
                doc: dict[str, Any] = json.load(f)
                return doc
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def forwarder_alive(self) -> bool:
        """Whether the forwarder process still runs (always true for netem)."""
        return self.backend == "netem" or (
            self.forwarder_pid is not None and pid_alive(self.forwarder_pid)
        )

    def wan_drops(self) -> dict[str, int]:
        """Drops on the WAN devices outside the emulated queue.

        For tun this is each TUN device's TX drops (the forwarder did not read
        fast enough) plus qdisc drops in front of it; for netem the qdisc drops
        include the emulated queue and loss, so only device TX drops count.
        """
        out = {}
        for side, ns in self.routers.items():
            doc = json.loads(ip("-s", "-j", "link", "show", "dev", _WAN_DEV, ns=ns))
            tx = doc[0].get("stats64", doc[0].get("stats", {})).get("tx", {})
            dropped = int(tx.get("dropped", 0))
            if self.backend == "tun":
                q = json.loads(
                    subprocess.run(
                        ["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", _WAN_DEV],
                        capture_output=True,
                        text=True,
                    ).stdout
                    or "[]"
                )
                dropped += sum(int(x.get("drops", 0)) for x in q)
            out[side] = dropped
        return out

    # -- persistence (pddnet wan up/down) -----------------------------------------------
    def to_state(self) -> dict[str, Any]:
        """JSON-friendly state for :meth:`from_state`."""
        return {
            "run_id": self.run_id,
            "backend": self.backend,
            "spec": self.spec.to_dict(),
            "workdir": self.workdir,
            "forwarder_pid": self.forwarder_pid,
            "hosts": {h.name: {"netns": h.netns, "addr": h.addr} for h in self.hosts.values()},
            "routers": self.routers,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Testbed:
        """Re-attach to a testbed built by another process (``pddnet wan up``)."""
        tb = cls(
            WanSpec.from_dict(state["spec"]),
            backend=state["backend"],
            persistent=True,
            workdir=state["workdir"],
        )
        tb.run_id = state["run_id"]
        tb.forwarder_pid = state["forwarder_pid"]
        tb.routers = dict(state["routers"])
        tb.hosts = {
            name: Host(name, h["netns"], h["addr"], tb) for name, h in state["hosts"].items()
        }
        return tb


@contextlib.contextmanager
def _thread_affinity(cpus: frozenset[int] | None) -> Iterator[None]:
    """The calling thread on ``cpus`` for the body (None: unchanged): a process
    it starts inherits them from the start, before it could start threads.
    Linux sets the affinity per thread, so the caller's other threads keep theirs."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _veth(name: str, peer: str, peer_ns: str, mtu: str, *, ns: str) -> None:
    """A veth pair in ``ns``: ``name`` stays there, ``peer`` moves into ``peer_ns``."""
    args = ["link", "add", name, "mtu", mtu, "type", "veth"]
    ip(*args, "peer", "name", peer, "mtu", mtu, "netns", peer_ns, ns=ns)


def _workdir_base() -> str:
    # tmpfs: the forwarder rewrites its stats file 4x a second, and a rename on a
    # disk filesystem can stall it for tens of ms (seen as late packets).
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    return os.path.join(base, "pddnet-emu")


def remove_stale_workdirs(prefix: str, *, only_dead: bool = True) -> list[str]:
    """Delete forwarder work directories ``PREFIX-PID-RUN`` whose creator PID is gone.

    Args:
        prefix: the run-name prefix (``pddt`` for tests, ``pddw`` for the CLI).
        only_dead: keep directories whose creator still runs.

    Returns:
        The directories removed.
    """
    base = _workdir_base()
    gone = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != prefix or not parts[1].isdigit():
            continue
        if only_dead and pid_alive(int(parts[1])):
            continue
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        gone.append(name)
    return gone


def _is_forwarder(pid: int) -> bool:
    """Whether ``pid`` is a pddnet forwarder (a recycled PID must not be killed)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"pddnet.emu._forwarder" in f.read()
    except OSError:
        return False


def netem_args(link: LinkSpec, mtu: int, rtt: float) -> list[str]:
    """The ``tc qdisc add ... netem`` arguments emulating one direction."""
    args = ["delay", f"{link.delay * 1e6:.0f}us"]
    if link.jitter:
        args += [f"{link.jitter * 1e6:.0f}us", "distribution", "normal"]
    if link.ge is not None:
        # netem takes one loss model; independent random loss folds exactly into
        # the Gilbert-Elliott per-state loss probabilities (1-h and 1-k).
        ge = link.ge
        keep = 1.0 - link.loss
        args += [
            "loss",
            "gemodel",
            f"{ge.p * 100:.6f}%",
            f"{ge.r * 100:.6f}%",
            f"{(1 - (1 - ge.loss_bad) * keep) * 100:.6f}%",
            f"{(1 - (1 - ge.loss_good) * keep) * 100:.6f}%",
        ]
    elif link.loss:
        args += ["loss", "random", f"{link.loss * 100:.6f}%"]
    if link.reorder:
        args += ["reorder", f"{link.reorder * 100:.6f}%"]
    if link.rate:
        args += ["rate", f"{link.rate:.0f}bit"]
    # netem's limit counts packets; it holds the delay line as well as the queue.
    inflight = (link.rate or 10e9) * (link.delay + 3 * link.jitter) / 8
    limit = (link.effective_queue_bytes(rtt) + inflight) / mtu
    args += ["limit", str(max(int(limit) + 16, 1000))]
    return args


@contextlib.contextmanager
def emulated_wan(
    rtt: str | float = "30ms",
    *,
    rate: str | float | None = None,
    loss: str | float = 0.0,
    jitter: str | float = "0ms",
    mtu: int = 1500,
    backend: str = "auto",
    spec: WanSpec | None = None,
    isolate_cpu: bool = False,
    **kwargs: Any,
) -> Iterator[Testbed]:
    """Build a ``pdd`` testbed for the body, and always tear it down.

    Args:
        rtt: base round-trip time between DC-A and DC-B.
        rate: per-direction bottleneck rate (``"1gbit"``), ``None`` unlimited.
        loss: per-direction random loss (``"0.1%"``).
        jitter: per-direction delay standard deviation.
        mtu: MTU of every link.
        backend: ``"auto"``, ``"netem"`` or ``"tun"``.
        spec: a full :class:`WanSpec` (overrides the other link arguments).
        isolate_cpu: the forwarder gets a CPU to itself (see :class:`Testbed`).
        **kwargs: more :meth:`WanSpec.symmetric` arguments (``queue``, ``reorder``,
            ``ge``, ``seed``, ``congestion_control``).

    Yields:
        The running :class:`Testbed`.

    Raises:
        TransportError: the testbed could not be built (not root, no netns, ...).
    """
    if spec is None:
        spec = WanSpec.symmetric(rtt=rtt, rate=rate, loss=loss, jitter=jitter, mtu=mtu, **kwargs)
    tb = Testbed(spec, backend=backend, isolate_cpu=isolate_cpu)
    try:
        tb.up()
        yield tb
    finally:
        tb.down()
