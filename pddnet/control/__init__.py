"""The control plane: authenticated msgpack messages between named nodes over pyzmq."""

from ._node import ControlNode, ControlStatistics, Handler
from ._secret import K_SECRET_ENV, load_secret
from ._tcp import TcpTuning

__all__ = [
    "K_SECRET_ENV",
    "ControlNode",
    "ControlStatistics",
    "Handler",
    "TcpTuning",
    "load_secret",
]
