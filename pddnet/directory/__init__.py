"""The cluster directory: instances register their handshake blob, role and
load; the others list and watch them. :class:`EtcdDirectory` on etcd (leases:
a dead instance leaves within the TTL), :class:`MemoryDirectory` in one
process. See docs/cluster.md."""

from ._base import Directory, DirectoryStats, Watch
from ._etcd import EtcdDirectory
from ._failover import FailoverSample, measure_failover
from ._member import DirectoryEvent, Load, Member, MemberJoined, MemberLeft, MemberUpdated
from ._memory import MemoryDirectory
from ._server import EtcdServer, find_etcd

__all__ = [
    "Directory",
    "DirectoryEvent",
    "DirectoryStats",
    "EtcdDirectory",
    "EtcdServer",
    "FailoverSample",
    "Load",
    "Member",
    "MemberJoined",
    "MemberLeft",
    "MemberUpdated",
    "MemoryDirectory",
    "Watch",
    "find_etcd",
    "measure_failover",
]
