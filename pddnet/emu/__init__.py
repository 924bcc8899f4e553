"""WAN emulation: a network-namespace testbed with netem, or a user-space TUN forwarder.

The ``pdd`` topology has three hosts, each a network namespace with one address:
``dc-a-p`` and ``dc-a-rld`` share a fast unshaped bridge (DC-A), and ``dc-b-md``
sits behind the shaped WAN (DC-B). When the kernel has ``sch_netem`` the WAN is a
veth pair with netem on each end; otherwise (as on the CI machines) a user-space
forwarder between two TUN devices applies delay, jitter, loss, Gilbert-Elliott
bursts, a rate limit with a drop-tail queue, and optional reordering. See
docs/wan-emulation.md.

From Python (benchmarks)::

    from pddnet.emu import emulated_wan

    with emulated_wan("30ms", rate="1gbit", loss="0.1%", mtu=9000) as wan:
        md = wan.md.spawn(["iperf3", "-s"])          # Popen, killed on teardown
        wan.p.run(["iperf3", "-c", wan.md.addr])    # CompletedProcess
        wan.md.call(mymodule.serve, 5555)           # a Python function on a host
        with wan.p.inside():                         # sockets made here live on dc-a-p
            sock = socket.create_connection((wan.md.addr, 5555))

In pytest, the ``wan_link`` fixture (``pddnet.emu._fixtures``, enabled by
``pytest_plugins``) is a factory with the same arguments::

    def test_x(wan_link):
        wan = wan_link(rtt="30ms", loss=0.0, rate="200mbit", mtu=9000)
        proc = wan.md.spawn([...]); wan.p.addr; wan["rld"].run([...])

Stable API (used by the WAN transport, handoff and demo tests):

- ``Testbed``: ``.p``, ``.rld``, ``.md``, ``[name]`` (``dc-a-p``/``p``, ...),
  ``.hosts``, ``.spec``, ``.backend`` (``"netem"``/``"tun"``),
  ``.forwarder_stats()``, ``.wan_drops()``, ``.up()``, ``.down()``, context manager.
- ``Host``: ``.name``, ``.addr``, ``.netns``, ``.spawn(argv, **popen_kw) -> Popen``,
  ``.run(argv, timeout=, check=) -> CompletedProcess``,
  ``.call(func, *args, **kw)`` (importable function, pickled args/result),
  ``.inside()`` (context manager: the calling thread's new sockets belong to the host).
- ``emulated_wan(rtt, *, rate, loss, jitter, mtu, backend, spec, **kw)``.
- ``unavailable_reason()``: why a testbed cannot be built here, or ``None``.
"""

from ._measure import Throughput, check, measure_loss, measure_rtt, measure_throughput
from ._netns import unavailable_reason
from ._shaper import DirectionShaper, ShaperStats
from ._spec import (
    GilbertElliott,
    LinkSpec,
    WanSpec,
    parse_bytes,
    parse_duration,
    parse_fraction,
    parse_rate,
)
from ._testbed import HOSTS, Host, Testbed, emulated_wan, netem_available

__all__ = [
    "HOSTS",
    "DirectionShaper",
    "GilbertElliott",
    "Host",
    "LinkSpec",
    "ShaperStats",
    "Testbed",
    "Throughput",
    "WanSpec",
    "check",
    "emulated_wan",
    "measure_loss",
    "measure_rtt",
    "measure_throughput",
    "netem_available",
    "parse_bytes",
    "parse_duration",
    "parse_fraction",
    "parse_rate",
    "unavailable_reason",
]
