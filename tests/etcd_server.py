"""A real etcd for the tests that need one (test files named for ``etcd`` or ``cluster``).

:func:`start_etcd` starts :class:`pddnet.directory.EtcdServer` (temporary data
directory, free ports on loopback or ``host``, 1 s leases allowed). Without an ``etcd`` binary
the test skips and says how to get one, except in CI (``CI`` set), where
``make test`` installs Debian's etcd-server: there a missing binary fails.
"""

from __future__ import annotations

import os

import pytest

from pddnet.directory import EtcdServer, find_etcd
from pddnet.directory._server import K_ETCD_HINT

__all__ = ["start_etcd"]


def start_etcd(host: str = "127.0.0.1") -> EtcdServer:
    """A started etcd listening on ``host``; the caller closes it."""
    if find_etcd() is None:
        if os.environ.get("CI"):
            pytest.fail(f"no etcd binary in CI, where `make test` installs it: {K_ETCD_HINT}")
        pytest.skip(f"no etcd binary: {K_ETCD_HINT}")
    server = EtcdServer(host=host)
    server.start()
    return server
