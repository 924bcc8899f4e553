"""The cluster directory on a real etcd (and the in-memory one, by the same contract).

Each test runs against a real etcd server (tests/etcd_server.py), in a cluster
name of its own; the lease tests kill real child processes that hold leases.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

from pddnet import (
    LocalProtocolError,
    PeerUnavailable,
    RemoteProtocolError,
    TransferTimeout,
    TransportError,
)
from pddnet.api import EndpointInfo
from pddnet.directory import (
    Directory,
    EtcdDirectory,
    EtcdServer,
    Load,
    MemberJoined,
    MemberLeft,
    MemberUpdated,
    MemoryDirectory,
    Watch,
    measure_failover,
)
from pddnet.directory._failover import spawn_holder
from pddnet.directory._http import HttpAddress, post_json, post_stream
from pddnet.directory._member import K_MAX_VALUE, encode_member
from pddnet.kv import KVLayout

sys.path.insert(0, str(Path(__file__).parent))
from etcd_server import start_etcd

LAYOUT = KVLayout(4, 2, 16, 16, "float16")


def info(name: str, role: str = "main", model: str = "") -> EndpointInfo:
    return EndpointInfo(name, role, name, 0, "tcp://127.0.0.1:9", "127.0.0.1:9", LAYOUT, model)


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    server = start_etcd()
    yield server
    server.close()


@pytest.fixture
def own_etcd() -> Iterator[EtcdServer]:
    """An etcd this test may stop, freeze and restart."""
    server = start_etcd()
    yield server
    server.close()


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> str:
    return f"t{os.getpid()}-{request.node.name}"[:100].replace("[", "-").replace("]", "")


async def next_event(events: Watch, timeout: float = 5.0) -> Any:
    with trio.fail_after(timeout):
        return await events.__anext__()


async def put_raw(url: str, key: str, value: bytes) -> None:
    """Write a value straight to etcd, as another (buggy or hostile) writer would."""
    payload = {
        "key": base64.b64encode(key.encode()).decode(),
        "value": base64.b64encode(value).decode(),
    }
    status, _ = await post_json(HttpAddress(url), "/v3/kv/put", payload, timeout=5, max_bytes=4096)
    assert status == 200


# -- one contract, both directories ---------------------------------------------------

Maker = Callable[[str], AbstractAsyncContextManager[tuple[Directory, Directory]]]


def makers(etcd_url: Callable[[], str]) -> dict[str, Maker]:
    @asynccontextmanager
    async def memory(cluster: str) -> AsyncIterator[tuple[Directory, Directory]]:
        async with MemoryDirectory(cluster) as d:
            yield d, d

    @asynccontextmanager
    async def on_etcd(cluster: str) -> AsyncIterator[tuple[Directory, Directory]]:
        url = etcd_url()
        async with (
            EtcdDirectory(url, cluster=cluster, ttl=5) as a,
            EtcdDirectory(url, cluster=cluster) as b,
        ):
            yield a, b

    return {"memory": memory, "etcd": on_etcd}


@pytest.fixture(params=["memory", "etcd"])
def pair(request: pytest.FixtureRequest) -> Maker:
    def url() -> str:
        server: EtcdServer = request.getfixturevalue("etcd")
        return server.url

    return makers(url)[request.param]


async def test_cluster_directory_register_list_get_watch(pair: Maker, cluster: str) -> None:
    """``a`` registers, ``b`` (another handle, another client) sees it all."""
    async with pair(cluster) as (a, b):
        await a.register(info("md0"), Load(active=1, free_blocks=100))
        await a.register(info("rld0", "relay"))
        assert [m.name for m in await b.members()] == ["md0", "rld0"]
        mains = await b.members("main")
        assert [(m.name, m.load.active, m.load.free_blocks) for m in mains] == [("md0", 1, 100)]
        assert mains[0].info == info("md0")  # the handshake blob round-trips
        assert await b.get("relay", "md0") is None
        async with b.watch("main") as events:
            first = await next_event(events)
            assert isinstance(first, MemberJoined) and first.member.name == "md0"
            await a.register(info("rld1", "relay"))  # another role: not in this watch
            await a.update_load("md0", Load(active=7))
            ev = await next_event(events)
            assert isinstance(ev, MemberUpdated) and ev.member.load.active == 7
            assert ev.member.revision > first.member.revision
            await a.register(info("md1"))
            ev = await next_event(events)
            assert isinstance(ev, MemberJoined) and ev.member.name == "md1"
            await a.deregister("md0")
            ev = await next_event(events)
            assert isinstance(ev, MemberLeft) and (ev.role, ev.name) == ("main", "md0")
        got = await b.get("main", "md1")
        assert got is not None and got.info == info("md1")
        assert [m.name for m in await b.members("main")] == ["md1"]
        member = await b.wait_for("main", "md1", timeout=5)
        assert member.name == "md1"
        with pytest.raises(TransferTimeout, match="main/nobody"):
            await b.wait_for("main", "nobody", timeout=0.3)
        with pytest.raises(LocalProtocolError, match="not registered"):
            await a.update_load("md0", Load())


async def test_cluster_directory_refuses_bad_names_and_oversized_values(
    pair: Maker, cluster: str
) -> None:
    async with pair(cluster) as (a, _):
        with pytest.raises(LocalProtocolError, match="without '/'"):
            await a.register(info("md/0"))
        with pytest.raises(LocalProtocolError, match="readers would refuse"):
            await a.register(info("md0", model="m" * 600), Load())  # a string over 512
        with pytest.raises(LocalProtocolError, match="role"):
            await a.members("decoder")
        with pytest.raises(LocalProtocolError):
            Load(active=-1)
        assert await a.members() == []


async def test_memory_directory_aclose_removes_its_members_and_ends_watches() -> None:
    d = MemoryDirectory("one-host")
    await d.register(info("md0"))
    async with d.watch() as events:
        assert isinstance(await next_event(events), MemberJoined)
        await d.aclose()
        ev = await next_event(events)
        assert isinstance(ev, MemberLeft) and ev.name == "md0"
        with pytest.raises(StopAsyncIteration):
            await next_event(events)
    assert await d.members() == []


# -- leases ------------------------------------------------------------------------------


async def test_etcd_killed_holder_drops_out_within_the_ttl(etcd: EtcdServer, cluster: str) -> None:
    """A child process holds the lease; alive it stays for many TTLs (keep-alives
    work), killed it is gone within the TTL plus etcd's expiry check."""
    ttl = 1
    async with EtcdDirectory(etcd.url, cluster=cluster) as d, d.watch("main") as events:
        child = spawn_holder(etcd.url, cluster, "md-child", ttl)
        try:
            ev = await next_event(events, timeout=30)
            assert isinstance(ev, MemberJoined) and ev.member.name == "md-child"
            assert await d.granted_ttl("main", "md-child") == ttl
            await trio.sleep(3 * ttl)  # three TTLs: only keep-alives keep it here
            assert [m.name for m in await d.members("main")] == ["md-child"]
            child.send_signal(signal.SIGKILL)
            t_kill = trio.current_time()
            ev = await next_event(events, timeout=10)
            gone_after = trio.current_time() - t_kill
        finally:
            child.kill()
            child.wait()
    assert isinstance(ev, MemberLeft) and ev.name == "md-child"
    # the lease's rest (<= TTL) + etcd's expiry loop (500 ms) + a loaded machine's margin
    assert gone_after <= ttl + 1.5, gone_after
    async with EtcdDirectory(etcd.url, cluster=cluster) as d:
        assert await d.members() == []


async def test_etcd_aclose_revokes_the_lease_at_once(etcd: EtcdServer, cluster: str) -> None:
    async with EtcdDirectory(etcd.url, cluster=cluster) as watcher, watcher.watch() as events:
        async with EtcdDirectory(etcd.url, cluster=cluster, ttl=30) as a:
            await a.register(info("md0"))
            assert isinstance(await next_event(events), MemberJoined)
        ev = await next_event(events, timeout=2)  # not the 30 s TTL
        assert isinstance(ev, MemberLeft) and ev.name == "md0"


async def test_etcd_lost_lease_registers_everything_again(etcd: EtcdServer, cluster: str) -> None:
    """A lease that expires under a live handle (as after a long partition) is
    noticed by the next keep-alive: the handle puts its members under a new one."""
    async with (
        EtcdDirectory(etcd.url, cluster=cluster, ttl=1) as a,
        EtcdDirectory(etcd.url, cluster=cluster) as watcher,
        watcher.watch() as events,
    ):
        await a.register(info("md0"))
        await a.register(info("rld0", "relay"))
        assert {(await next_event(events)).member.name for _ in range(2)} == {"md0", "rld0"}
        old = a.statistics().lease_id
        status, _ = await post_json(
            HttpAddress(etcd.url), "/v3/lease/revoke", {"ID": str(old)}, timeout=5, max_bytes=4096
        )
        assert status == 200
        left = {(await next_event(events)).name for _ in range(2)}
        back = {(await next_event(events, timeout=5)).member.name for _ in range(2)}
        assert left == back == {"md0", "rld0"}
        stats = a.statistics()
        assert stats.leases_lost == 1 and stats.lease_id not in (0, old)
        assert {m.name for m in await watcher.members()} == {"md0", "rld0"}


async def test_etcd_put_under_a_lost_lease_moves_every_member_to_a_new_one(
    etcd: EtcdServer, cluster: str
) -> None:
    """A load update that meets etcd's "lease not found" (before any keep-alive
    noticed) grants a new lease and puts the handle's other members under it too."""
    async with (
        EtcdDirectory(etcd.url, cluster=cluster, ttl=30) as a,
        EtcdDirectory(etcd.url, cluster=cluster) as watcher,
        watcher.watch() as events,
    ):
        await a.register(info("md0"))
        await a.register(info("rld0", "relay"))
        assert {(await next_event(events)).member.name for _ in range(2)} == {"md0", "rld0"}
        old = a.statistics().lease_id
        status, _ = await post_json(
            HttpAddress(etcd.url), "/v3/lease/revoke", {"ID": str(old)}, timeout=5, max_bytes=4096
        )
        assert status == 200
        assert {(await next_event(events)).name for _ in range(2)} == {"md0", "rld0"}
        await a.update_load("md0", Load(active=5))
        stats = a.statistics()
        assert stats.leases_lost == 1 and stats.lease_id not in (0, old)
        assert stats.keepalives == 0  # the put found out, not a keep-alive (every 10 s)
        back = {m.name: m.load.active for m in await watcher.members()}
        assert back == {"md0": 5, "rld0": 0}
        assert await a.granted_ttl("relay", "rld0") == 30


async def test_measure_failover_reports_the_lease_ttl_plus_detection(etcd: EtcdServer) -> None:
    sample = await measure_failover(etcd.url, ttl=1)
    assert sample.lease_ttl == 1
    # killed just after the grant: the whole TTL, plus etcd's 500 ms expiry check
    assert 0.9 <= sample.failover_s <= 1.0 + 1.5, sample


# -- etcd down, frozen, restarted --------------------------------------------------------


async def test_etcd_down_gives_typed_errors_not_hangs(own_etcd: EtcdServer, cluster: str) -> None:
    url = own_etcd.url
    async with EtcdDirectory(url, cluster=cluster, ttl=1, timeout=1.0) as d:
        await d.register(info("md0"))
        async with d.watch() as events:
            assert isinstance(await next_event(events), MemberJoined)
            own_etcd.stop()  # SIGKILL: the watch stream breaks
            with pytest.raises(PeerUnavailable, match=url):
                await next_event(events, timeout=3)
        with trio.fail_after(3):
            with pytest.raises(PeerUnavailable, match="cannot connect"):
                await d.members()
            with pytest.raises(PeerUnavailable):
                await d.register(info("md1"))
            with pytest.raises(PeerUnavailable):
                async with d.watch():
                    pass
        await trio.sleep(1.0)  # keep-alives fail meanwhile, and are counted
        assert d.statistics().keepalive_failures >= 1
        own_etcd.start()  # same data: the lease and md0 survive the restart
        with trio.fail_after(10):
            while [m.name for m in await d.members()] != ["md0"]:
                await trio.sleep(0.1)
        failures = d.statistics().keepalive_failures
        await trio.sleep(1.0)
        assert d.statistics().keepalive_failures == failures  # keep-alives get through again
        assert [m.name for m in await d.members()] == ["md0"]


async def test_etcd_frozen_gives_a_timeout_and_breaks_the_watch(
    own_etcd: EtcdServer, cluster: str
) -> None:
    """SIGSTOP: connections stay open and nothing answers (as across a partition)."""
    proc = own_etcd._proc
    assert proc is not None
    async with EtcdDirectory(own_etcd.url, cluster=cluster, timeout=0.5) as d:
        async with d.watch() as events:
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                t0 = trio.current_time()
                with pytest.raises(TransferTimeout):
                    await next_event(events, timeout=5)
                assert trio.current_time() - t0 <= 2.0  # heartbeat period + its deadline
                with trio.fail_after(2), pytest.raises(TransferTimeout, match=r"within 0\.5s"):
                    await d.members()
            finally:
                os.kill(proc.pid, signal.SIGCONT)
        assert await d.members() == []


# -- what comes back from etcd is checked ------------------------------------------------


async def test_etcd_malformed_or_oversized_values_are_refused(
    etcd: EtcdServer, cluster: str
) -> None:
    prefix = f"/pddnet/{cluster}/main/"
    async with EtcdDirectory(etcd.url, cluster=cluster) as d, d.watch("main") as events:
        await put_raw(etcd.url, prefix + "garbage", b"\xc1not msgpack")
        await put_raw(etcd.url, prefix + "big", b"x" * (K_MAX_VALUE + 1))
        await put_raw(etcd.url, prefix + "liar", encode_member(info("md9"), Load()))
        await put_raw(etcd.url, prefix + "old", msgpack.packb([99, info("old").blob(), {}]))
        await put_raw(etcd.url, prefix + "ok", encode_member(info("ok"), Load(active=3)))
        # the watch skips the four bad values and delivers the good one
        ev = await next_event(events)
        assert isinstance(ev, MemberJoined) and ev.member.name == "ok"
        assert [m.name for m in await d.members("main")] == ["ok"]
        assert d.statistics().malformed == 8  # four in the watch, four in the listing
        with pytest.raises(RemoteProtocolError, match="malformed directory value"):
            await d.get("main", "garbage")
        with pytest.raises(RemoteProtocolError, match=f"over {K_MAX_VALUE} bytes"):
            await d.get("main", "big")
        with pytest.raises(RemoteProtocolError, match="holds main/md9"):
            await d.get("main", "liar")
        with pytest.raises(RemoteProtocolError, match="version 99"):
            await d.get("main", "old")


@asynccontextmanager
async def fake_gateway(answer: bytes) -> AsyncIterator[str]:
    """A loopback server that answers every connection with ``answer``, then waits."""

    async def handler(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await stream.send_all(answer)
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


async def test_etcd_client_bounds_what_a_gateway_sends() -> None:
    huge = b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n" + b" " * 70000
    async with fake_gateway(huge) as url:
        with trio.fail_after(3), pytest.raises(RemoteProtocolError, match="longer than 65536"):
            await post_json(HttpAddress(url), "/v3/kv/range", {}, timeout=2, max_bytes=65536)
    line = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n11170\r\n" + b"x" * 70000
    async with (
        fake_gateway(line) as url,
        post_stream(HttpAddress(url), "/v3/watch", {}, timeout=2, max_line=65536) as it,
    ):
        with trio.fail_after(3), pytest.raises(RemoteProtocolError, match="line longer"):
            await it.__anext__()
    async with fake_gateway(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nnot json") as url:
        with pytest.raises(RemoteProtocolError, match="malformed JSON"):
            async with EtcdDirectory(url) as d:
                await d.members()
    async with fake_gateway(b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found") as url:
        with pytest.raises(RemoteProtocolError, match="HTTP 404: not found"):
            await EtcdDirectory(url).members()
    async with fake_gateway(b"not http at all\r\n\r\n") as url:
        with pytest.raises(RemoteProtocolError, match="bad HTTP"):
            await EtcdDirectory(url).members()
    async with fake_gateway(b"") as url:  # accepts, never answers
        with trio.fail_after(3), pytest.raises(TransferTimeout, match=r"within 0\.5s"):
            await EtcdDirectory(url, timeout=0.5).members()


async def test_etcd_register_needs_the_async_with(etcd: EtcdServer) -> None:
    with pytest.raises(LocalProtocolError, match="async with"):
        await EtcdDirectory(etcd.url).register(info("md0"))
    with pytest.raises(LocalProtocolError, match="http://host:port"):
        EtcdDirectory("https://127.0.0.1:2379")
    assert issubclass(PeerUnavailable, TransportError)


def test_etcd_bench_route_reports_failover_s(etcd: EtcdServer, tmp_path: Path) -> None:
    from pddnet.bench import route

    parser = argparse.ArgumentParser()
    route.add_arguments(parser)
    out = tmp_path / "route.json"
    argv = ["--quick", "--etcd", etcd.url, "--ttl", "1", "--reps", "2", "--json", str(out)]
    assert route.main(parser.parse_args(argv)) == 0
    report = json.loads(out.read_text())
    samples = [s["failover_s"] for s in report["failover_samples"]]
    assert len(samples) == 2 and report["summary"]["failover_s"] == max(samples)
    assert report["summary"]["lease_ttl_s"] == 1
    assert all(0.9 <= s <= 2.5 for s in samples), samples


def test_etcd_docs_cluster_example_runs_as_written(etcd: EtcdServer) -> None:
    """docs/cluster.md's example (it starts its own throwaway etcd)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "cluster.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["['md0']", "MemberJoined", "MemberUpdated", "MemberLeft"]
