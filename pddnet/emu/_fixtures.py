"""pytest plugin: the ``wan_link`` fixture (enable with ``pytest_plugins``).

``wan_link`` is a factory fixture::

    def test_handoff(wan_link):
        wan = wan_link(rtt="30ms", loss="0.1%", rate="1gbit", mtu=9000)
        server = wan.md.spawn(["python", "-m", "my.server", "--bind", wan.md.addr])
        ...

Arguments are those of :func:`pddnet.emu.emulated_wan` (``rtt``, ``rate``,
``loss``, ``jitter``, ``mtu``, ``backend``, ``spec``, ``queue``, ``reorder``,
``ge``, ``seed``, ``congestion_control``). Each call builds a fresh
:class:`pddnet.emu.Testbed` and returns it; its hosts are ``wan.p``,
``wan.rld``, ``wan.md`` (or ``wan["dc-a-p"]``...), each with ``addr``,
``spawn(argv)`` (a Popen), ``run(argv)``, ``call(func, ...)`` and ``inside()``.

Guarantees:

- Teardown always runs at the end of the test, also on failure or Ctrl-C:
  processes are stopped by PID (SIGTERM, then SIGKILL), then the namespaces are
  deleted. The forwarder exits when the test process dies, even by SIGKILL.
- Namespace names are ``pddt-PID-RUN-ROLE``; at session start, namespaces with
  that prefix whose PID is dead (crashed runs) are removed.
- The test is skipped, with the reason, when not root or when network
  namespaces, veth or ``/dev/net/tun`` (needed without netem) are unavailable.
- Traffic stays inside the namespaces the fixture created.

The ``netns`` marker is applied to tests that use the fixture.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ._netns import remove_stale, unavailable_reason
from ._testbed import Testbed, emulated_wan, netem_available, remove_stale_workdirs

__all__ = ["wan_link"]

K_PREFIX = "pddt"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Remove namespaces left by crashed runs (dead creator PID)."""
    if os.geteuid() == 0:
        if os.path.isdir("/run/netns"):
            remove_stale(K_PREFIX)
        remove_stale_workdirs(K_PREFIX)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses ``wan_link`` with ``netns``."""
    for item in items:
        if "wan_link" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.netns)


def _skip_reason(backend: str) -> str | None:
    reason = unavailable_reason()
    if reason:
        return reason
    if backend == "netem":
        return None if netem_available() else "kernel has no sch_netem"
    no_tun = not os.path.exists("/dev/net/tun")
    if no_tun and (backend == "tun" or (backend == "auto" and not netem_available())):
        return "needs /dev/net/tun (no netem here)"
    return None


@pytest.fixture
def wan_link() -> Iterator[Callable[..., Testbed]]:
    """Factory: ``wan_link(rtt=..., loss=..., rate=..., mtu=...) -> Testbed`` (torn down after)."""
    stack: list[Any] = []

    def make(rtt: str | float = "30ms", **kwargs: Any) -> Testbed:
        reason = _skip_reason(kwargs.get("backend", "auto"))
        if reason:
            pytest.skip(f"emulated WAN unavailable: {reason}")
        cm = emulated_wan(rtt, **kwargs)
        tb = cm.__enter__()
        stack.append(cm)
        return tb

    try:
        yield make
    finally:
        while stack:
            stack.pop().__exit__(None, None, None)
