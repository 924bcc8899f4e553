"""A fork server for ``pddnet demo --engine vllm``: import vLLM once, fork every vLLM process.

Importing vLLM costs about 10 CPU seconds, building its engine afterwards
about 2 (measured on this 2-core machine: 12-15 s wall to build an engine
in a fresh process, 1.8 s in a child forked after the imports). The demo runs
seven vLLM processes (P, RLD and MD for each phase, then the oracle), so it
starts one zygote first, which imports vLLM and pddnet's vLLM modules and
then forks each of them on request. Every child starts from the same
imported, never-used state (no engine built, no cache, no connection, one
thread), so the two phases' processes are as fresh and as equal as
processes started from scratch.

The child of a request runs ``python -m pddnet.demo._vllm_roles ROLE CONFIG``
(:func:`pddnet.demo._vllm_roles.main`), inside the named network namespace
if one is given (as ``ip netns exec`` does: the namespace, then a private
mount namespace with that namespace's ``/sys``). Its stdout and stderr go
to a pipe the demo passes with the request (SCM_RIGHTS over a Unix
socketpair); the zygote reports each child's pid and exit status back.

The zygote runs :func:`serve` on the socketpair's end, importing the
modules it is given. The
zygote stays single-threaded (it forks), polls its socket, and kills its
children and exits when the demo closes its end.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import IO, Any, Protocol

from .._errors import LocalProtocolError

__all__ = ["RoleProcess", "Zygote", "ZygoteProcess"]

#: What the zygote imports before it forks: the role module (pddnet, trio,
#: the integration) and the vLLM modules that building a CPU engine over a
#: Llama checkpoint imports lazily (without them a child spends ~8 s on them).
K_PRELOAD = (
    "pddnet.demo._vllm_roles",
    "pddnet.integrations.vllm.connectors",
    "vllm.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.model_executor.models.llama",
)
K_ROLES_MODULE = "pddnet.demo._vllm_roles"
K_MSG = 4096  # bytes per message on the socketpair

_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 0x80000, 2
_PR_SET_PDEATHSIG = 1


class RoleProcess(Protocol):
    """What the demo needs of a role's process: ``subprocess.Popen`` or :class:`ZygoteProcess`."""

    @property
    def stdout(self) -> IO[str] | None: ...

    @property
    def returncode(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]: ...


class ZygoteProcess:
    """A process the zygote forked: ``subprocess.Popen``'s calls the demo uses.

    ``stdout`` is the read end of its output pipe (stdout and stderr together).
    """

    def __init__(self, pid: int, stdout: IO[str], exited: threading.Event, status: dict[int, int]):
        self.pid = pid
        self.stdout: IO[str] | None = stdout
        self._exited = exited
        self._status = status

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: killed by that signal), or None while it runs."""
        return self._status.get(self.pid)

    def kill(self) -> None:
        """SIGKILL it (nothing if it has already exited)."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        """Wait until the zygote has reaped it.

        Raises:
            subprocess.TimeoutExpired: it is still running after ``timeout`` seconds.
        """
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0.0)
        return self._status[self.pid]

    def communicate(self, input: None = None, timeout: float | None = None) -> tuple[str, None]:
        """Its remaining output once it has exited, as ``Popen.communicate`` (no ``input``).

        Raises:
            subprocess.TimeoutExpired: it is still running after ``timeout`` seconds.
        """
        assert self.stdout is not None
        self.wait(timeout)
        out = self.stdout.read()  # EOF: the child, its only writer, is gone
        self.stdout.close()
        return out, None


class Zygote:
    """The demo's side of the fork server: ``with Zygote() as z: z.spawner(netns)(argv, ...)``.

    Args:
        env: the zygote's environment, inherited by every child (values read
            when a library loads, such as ``OMP_NUM_THREADS``, must be here);
            each request can add more.
        preload: the modules it imports before it forks.
    """

    def __init__(
        self, env: Mapping[str, str] | None = None, preload: Sequence[str] = K_PRELOAD
    ) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        main = (
            "import sys; from pddnet.demo._zygote import serve;"
            " serve(int(sys.argv[1]), sys.argv[2:])"
        )
        argv = [sys.executable, "-c", main, str(theirs.fileno()), *preload]
        self._proc = subprocess.Popen(argv, env=dict(env or os.environ), pass_fds=[theirs.fileno()])
        theirs.close()
        self._lock = threading.Lock()  # one request at a time on the socket
        self._pids: dict[int, threading.Event] = {}  # request number -> its pid's arrival
        self._pid_of: dict[int, int] = {}
        self._exited: dict[int, threading.Event] = {}
        self._status: dict[int, int] = {}
        self._requests = 0
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the zygote (it kills any child still running, and reports it) and wait for it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)  # the zygote's EOF
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=30)
        self._sock.close()

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(K_MSG)
            except OSError:
                data = b""
            if not data:  # the zygote is gone, and its children with it (PDEATHSIG)
                for pid in self._exited:
                    self._status.setdefault(pid, -int(signal.SIGKILL))
                for ev in (*self._pids.values(), *self._exited.values()):
                    ev.set()
                return
            msg = json.loads(data)
            if "request" in msg:
                self._pid_of[msg["request"]] = msg["pid"]
                self._exited.setdefault(msg["pid"], threading.Event())
                self._pids[msg["request"]].set()
            else:
                self._status[msg["exit"]] = msg["status"]
                self._exited.setdefault(msg["exit"], threading.Event()).set()

    def spawner(self, netns: str | None = None) -> Callable[..., ZygoteProcess]:
        """A ``subprocess.Popen``-like callable that forks ``argv`` from the zygote.

        ``argv`` must be ``[python, "-m", "pddnet.demo._vllm_roles", ROLE, CONFIG]``
        (what the zygote can run); of Popen's keywords only ``env`` counts (the
        child's output always comes back on a text pipe, stderr with stdout).
        """

        def spawn(
            argv: Sequence[str], *, env: Mapping[str, str] | None = None, **_: Any
        ) -> ZygoteProcess:
            return self.fork(argv, env=env, netns=netns)

        return spawn

    def fork(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        netns: str | None = None,
        timeout: float = 60.0,
    ) -> ZygoteProcess:
        """Fork ``argv`` (a ``pddnet.demo._vllm_roles`` command line) in the zygote.

        Args:
            argv: ``[python, "-m", "pddnet.demo._vllm_roles", ROLE, CONFIG]``.
            env: the child's environment (only what differs from the zygote's is sent).
            netns: the network namespace to run it in, or None.
            timeout: how long to wait for the zygote (it answers once its imports are done).

        Raises:
            LocalProtocolError: ``argv`` is not a role command line, or the
                zygote did not answer in time (it failed or is gone).
        """
        if list(argv[1:3]) != ["-m", K_ROLES_MODULE] or len(argv) < 4:
            raise LocalProtocolError(f"the zygote runs {K_ROLES_MODULE} only, not {argv[:4]}")
        delta = {k: v for k, v in (env or {}).items() if os.environ.get(k) != v}
        r, w = os.pipe()
        with self._lock, tempfile.TemporaryFile() as body:
            self._requests += 1
            req = self._requests
            self._pids[req] = threading.Event()
            # the request in a file (the oracle's prompts exceed a socket message)
            msg = {"request": req, "args": list(argv[3:]), "env": delta, "netns": netns}
            body.write(json.dumps(msg).encode())
            body.flush()
            try:
                socket.send_fds(self._sock, [b"fork"], [w, body.fileno()])
            finally:
                os.close(w)
        if not self._pids[req].wait(timeout) or req not in self._pid_of:
            os.close(r)
            raise LocalProtocolError(
                f"the vLLM zygote did not fork {argv[3]} within {timeout:g} s"
                f" (zygote exit status {self._proc.poll()})"
            )
        pid = self._pid_of[req]
        return ZygoteProcess(pid, os.fdopen(r, "r"), self._exited[pid], self._status)


# ------------------------------------------------------------ the zygote
def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _enter(netns: str) -> None:
    """Join ``netns`` as ``ip netns exec`` does (its /sys included)."""
    from ..emu._netns import NETNS_DIR, setns_path

    libc = _libc()
    setns_path(os.path.join(NETNS_DIR, netns))
    _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    _check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    _check(libc.mount(netns.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs /sys")


def _child(msg: dict[str, Any], out: int) -> int:
    """(In the forked child) run the role; returns the exit status."""
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the zygote
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.update(msg["env"])
    try:
        if msg["netns"]:
            _enter(msg["netns"])
        from . import _vllm_roles

        _vllm_roles.main(msg["args"])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()  # os._exit follows: nothing else flushes them
        sys.stderr.flush()
    return 0


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def _reap(children: set[int]) -> Iterator[tuple[int, int]]:
    for pid in list(children):
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            yield pid, _status(raw)


def serve(fd: int, preload: Iterable[str] = K_PRELOAD) -> None:
    """The zygote: import ``preload``, then fork a child per request on ``fd``."""
    from ..integrations.vllm import apply_cpu_env

    apply_cpu_env()
    for name in preload:
        importlib.import_module(name)
    # what was imported is permanent: no child's collection walks it (vLLM's
    # engine build collects five times: 0.95 s of 2.2 without this, 0.03 with)
    gc.collect()
    gc.freeze()
    sock = socket.socket(fileno=fd)
    children: set[int] = set()

    def report(pid: int, status: int) -> None:
        sock.send(json.dumps({"exit": pid, "status": status}).encode())

    try:
        while True:
            ready, _, _ = select.select([sock], [], [], 0.2)
            for pid, status in _reap(children):
                report(pid, status)
            if not ready:
                continue
            data, fds, _flags, _addr = socket.recv_fds(sock, K_MSG, 2)
            if not data:
                return  # the demo is done
            out, body = fds
            with os.fdopen(body, "rb") as f:
                f.seek(0)
                msg = json.loads(f.read())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sock.close()
                os._exit(_child(msg, out))
            os.close(out)
            children.add(pid)
            sock.send(json.dumps({"request": msg["request"], "pid": pid}).encode())
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            status = _status(os.waitpid(pid, 0)[1])
            with contextlib.suppress(OSError):
                report(pid, status)
        sock.close()
        gc.unfreeze()  # collected at exit as usual (frozen, triton's bindings report leaks)
