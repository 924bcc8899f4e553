"""A throwaway single-member etcd server on loopback, for tests and benchmarks.

It runs the ``etcd`` binary (Debian's ``etcd-server``: ``make system`` installs
it where root) with its data in a temporary directory and its client and peer
ports picked free on 127.0.0.1 (or another local address). Its Raft clock runs ten times faster than
etcd's default (10 ms heartbeats), which lets etcd grant 1 s leases: its
minimum TTL is 1.5 election timeouts, rounded up.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from .._errors import PeerUnavailable

__all__ = ["EtcdServer", "find_etcd"]

K_ETCD_HINT = "install Debian's etcd-server (`sudo apt-get install etcd-server`, or `make system`)"


def find_etcd() -> str | None:
    """The path of the ``etcd`` binary on PATH (or /usr/bin), or None."""
    return shutil.which("etcd") or shutil.which("etcd", path="/usr/bin:/usr/sbin")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """``with EtcdServer() as url:`` an etcd serving at ``url`` until the block ends.

    :meth:`stop` and :meth:`start` restart it on the same ports and data (the
    leases survive a restart; their TTL restarts with them).

    Args:
        binary: the etcd binary (default: :func:`find_etcd`).
        host: the local IPv4 address it listens on (clients and its peer
            port); in a network namespace, build and start it from a thread
            inside that namespace (as ``pddnet.emu.Host.inside`` runs one).

    Raises:
        PeerUnavailable: if there is no etcd binary (the message says how to get it).
    """

    def __init__(self, binary: str | None = None, *, host: str = "127.0.0.1") -> None:
        found = binary or find_etcd()
        if found is None:
            raise PeerUnavailable(f"no etcd binary: {K_ETCD_HINT}")
        self.binary = found
        self._tmp = tempfile.TemporaryDirectory(prefix="pddnet-etcd-")
        self.data_dir = Path(self._tmp.name) / "data"
        self.log_path = Path(self._tmp.name) / "etcd.log"
        self.host = host
        self.client_port, self.peer_port = _free_port(host), _free_port(host)
        self.url = f"http://{host}:{self.client_port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> None:
        """Start etcd and wait until it answers ``/health``.

        Raises:
            PeerUnavailable: if it exits or is not healthy within ``timeout``
                seconds (the message ends with its log's tail).
        """
        peer = f"http://{self.host}:{self.peer_port}"
        cmd = [
            self.binary,
            "--name=pddnet-test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=pddnet-test={peer}",
            "--heartbeat-interval=10",
            "--election-timeout=100",
            "--logger=zap",
            "--log-level=warn",
        ]
        with self.log_path.open("ab") as logf:
            self._proc = subprocess.Popen(cmd, stdout=logf, stderr=logf, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as r:
                    if b'"true"' in r.read(256):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        self.stop()
        raise PeerUnavailable(f"etcd did not start at {self.url}: {tail}", peer=self.url)

    def stop(self) -> None:
        """Kill etcd (SIGKILL: as a crash) and reap it; the data stays."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Stop etcd and remove its data."""
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> str:
        self.start()
        return self.url

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
