"""A child process that holds a directory lease until it is killed.

``python -m pddnet.directory._holder URL CLUSTER NAME TTL`` registers
:func:`holder_info` (``NAME``) on etcd at ``URL`` under a ``TTL`` lease and
keeps it alive; it exits 3 if it cannot. :func:`~pddnet.directory.measure_failover`
and the tests kill it to see how long the directory takes to notice. (Not
imported by the package, so ``-m`` runs it fresh.)
"""

from __future__ import annotations

import sys

import trio

from ..api import EndpointInfo
from ..kv import KVLayout
from ._etcd import EtcdDirectory

__all__ = ["holder_info"]


def holder_info(name: str) -> EndpointInfo:
    """The endpoint a holder registers: a ``main`` role with a tiny layout."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16)
    return EndpointInfo(name, "main", name, 0, "tcp://127.0.0.1:1", "127.0.0.1:1", layout)


async def _hold(url: str, cluster: str, name: str, ttl: int) -> None:
    async with EtcdDirectory(url, cluster=cluster, ttl=ttl) as d:
        await d.register(holder_info(name))
        await trio.sleep_forever()


if __name__ == "__main__":
    try:
        trio.run(_hold, sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
    except Exception as exc:
        print(f"holder: {exc}", file=sys.stderr)
        sys.exit(3)
