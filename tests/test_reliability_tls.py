"""TLS on the WAN streams: conformance over real loopback TLS, and every way to get it wrong.

Certificates are throwaway ones made per module with the ``openssl`` command
(:func:`pddnet.transport.testing.make_test_certs`); the module skips without it.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.socket as tsocket

from pddnet import AuthError, LocalProtocolError, PddnetError
from pddnet.kv import ByteRanges
from pddnet.transport import Receiver, Sender
from pddnet.transport.testing import CHECKS, TestCerts, check_transport, make_test_certs
from pddnet.transport.wan import TlsConfig, WanReceiver, WanSender

SECRET = b"tls-test-secret-0123456789abcdef"
K_BOUND_S = 10.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TestCerts:
    made = make_test_certs(tmp_path_factory.mktemp("certs"))
    if made is None:
        pytest.skip("no openssl command to make test certificates")
    return made


def server_tls(c: TestCerts, *, mutual: bool = True) -> TlsConfig:
    return TlsConfig(
        cert=c.server_cert,
        key=c.server_key,
        ca=c.ca if mutual else None,
        require_client_cert=mutual,
    )


def client_tls(c: TestCerts, *, cert: bool = True, **kw: object) -> TlsConfig:
    opts: dict[str, object] = {"ca": c.ca, **kw}
    if cert:
        opts.update(cert=c.client_cert, key=c.client_key)
    return TlsConfig(**opts)  # type: ignore[arg-type]


def tls_maker(rx_kw: dict[str, object], tx_kw: dict[str, object]):  # type: ignore[no-untyped-def]
    @asynccontextmanager
    async def maker() -> AsyncIterator[tuple[Sender, Receiver]]:
        async with WanReceiver(**rx_kw) as rx:  # type: ignore[arg-type]
            opts = {"streams": 3, "chunk_size": 256 << 10, **tx_kw}
            async with WanSender(rx.address, **opts) as tx:  # type: ignore[arg-type]
                yield tx, rx

    return maker


async def test_conformance_over_mutual_tls_with_secret(certs: TestCerts) -> None:
    maker = tls_maker(
        {"tls": server_tls(certs), "secret": SECRET},
        {"tls": client_tls(certs), "secret": SECRET},
    )
    ran = await check_transport(maker)
    assert ran == list(CHECKS)


async def test_server_only_tls_without_secret(certs: TestCerts) -> None:
    maker = tls_maker(
        {"tls": server_tls(certs, mutual=False)}, {"tls": client_tls(certs, cert=False)}
    )
    ran = await check_transport(maker, only=["roundtrip", "concurrent", "layers"])
    assert len(ran) == 3


async def test_tls_socket_and_channel_binding_are_in_use(certs: TestCerts) -> None:
    async with (
        WanReceiver(tls=server_tls(certs), secret=SECRET) as rx,
        WanSender(rx.address, tls=client_tls(certs), secret=SECRET, streams=2) as tx,
    ):
        with trio.fail_after(K_BOUND_S):
            await tx.wait_connected()
        socks = [s.sock for s in tx._streams]
        assert all(isinstance(s, ssl.SSLSocket) for s in socks)
        assert all(s.version() in ("TLSv1.3", "TLSv1.2") for s in socks)
        assert all(len(s.get_channel_binding("tls-unique") or b"") >= 12 for s in socks)
        st = rx.statistics()
        assert st.tls_failures == 0 and st.auth_failures == 0


def _case(n: int = 1 << 20) -> tuple[ByteRanges, bytearray, bytearray]:
    return ByteRanges.build([0], [0], [n], [0]), bytearray(os.urandom(n)), bytearray(n)


async def _refused(
    rx: WanReceiver, tx_kw: dict[str, object], match: str | None = None
) -> AuthError:
    """A sender with ``tx_kw`` fails its transfer with AuthError; no byte lands."""
    ranges, src, dst = _case()
    grant = rx.grant([dst], ranges, timeout=K_BOUND_S)
    async with WanSender(rx.address, streams=2, peer_timeout=5.0, **tx_kw) as tx:  # type: ignore[arg-type]
        with trio.fail_after(K_BOUND_S), pytest.raises(AuthError, match=match) as info:
            await tx.send(grant, [src], ranges, timeout=K_BOUND_S)
    assert dst == bytearray(len(dst)), "a byte landed over a refused connection"
    assert rx.statistics().bytes_verified == 0
    rx.cancel(grant.transfer_id)
    assert rx.statistics().grants == 0 and rx.statistics().bytes_granted == 0
    return info.value


async def test_plaintext_sender_against_tls_receiver_is_refused(certs: TestCerts) -> None:
    async with WanReceiver(tls=server_tls(certs), secret=SECRET) as rx:
        err = await _refused(rx, {"secret": SECRET}, "rejected our authentication")
        assert err.peer == rx.address and err.transfer_id is not None
        with trio.fail_after(K_BOUND_S):
            while rx.statistics().tls_failures == 0:
                await trio.sleep(0.01)


async def test_plaintext_raw_client_is_dropped_without_a_hang(certs: TestCerts) -> None:
    async with WanReceiver(tls=server_tls(certs, mutual=False)) as rx:
        host, port = rx.address.rsplit(":", 1)
        sock = tsocket.socket()
        await sock.connect((host, int(port)))
        await sock.send(b"PDDX" + bytes(36))  # a link frame, in the clear
        with trio.fail_after(K_BOUND_S):
            data = b""
            while True:
                try:
                    got = await sock.recv(4096)
                except OSError:
                    break
                if not got:
                    break
                data += got
        sock.close()
        assert not data or data[0] == 0x15  # nothing, or a TLS alert record
        assert rx.statistics().tls_failures == 1
        assert rx.statistics().connections == 0


async def test_silent_client_is_dropped_after_the_handshake_timeout(certs: TestCerts) -> None:
    tls = TlsConfig(cert=certs.server_cert, key=certs.server_key, handshake_timeout=0.3)
    async with WanReceiver(tls=tls) as rx:
        host, port = rx.address.rsplit(":", 1)
        sock = tsocket.socket()
        await sock.connect((host, int(port)))
        with trio.fail_after(K_BOUND_S):
            assert await sock.recv(4096) == b""  # closed by the receiver, not by us
        sock.close()
        assert rx.statistics().tls_failures == 1


async def test_wrong_ca_on_the_sender_is_refused(certs: TestCerts) -> None:
    async with WanReceiver(tls=server_tls(certs), secret=SECRET) as rx:
        wrong = TlsConfig(cert=certs.client_cert, key=certs.client_key, ca=certs.other_ca)
        await _refused(rx, {"secret": SECRET, "tls": wrong}, "certificate verify failed")


async def test_wrong_hostname_is_refused(certs: TestCerts) -> None:
    async with WanReceiver(tls=server_tls(certs), secret=SECRET) as rx:
        wrong = client_tls(certs, server_hostname="md.example.net")
        await _refused(rx, {"secret": SECRET, "tls": wrong}, "certificate verify failed: Hostname")


async def test_sender_without_client_certificate_is_refused_by_mutual_tls(
    certs: TestCerts,
) -> None:
    async with WanReceiver(tls=server_tls(certs), secret=SECRET) as rx:
        err = await _refused(rx, {"secret": SECRET, "tls": client_tls(certs, cert=False)})
        assert "TLS" in str(err)
        assert rx.statistics().tls_failures >= 1


async def test_client_certificate_from_another_ca_is_refused(
    certs: TestCerts, tmp_path: Path
) -> None:
    # the receiver trusts only other_ca for clients: the real client cert is foreign to it
    tls = TlsConfig(
        cert=certs.server_cert, key=certs.server_key, ca=certs.other_ca, require_client_cert=True
    )
    async with WanReceiver(tls=tls, secret=SECRET) as rx:
        err = await _refused(rx, {"secret": SECRET, "tls": client_tls(certs)})
        assert "TLS" in str(err)
        assert rx.statistics().tls_failures >= 1


async def test_tls_receiver_with_wrong_secret_still_refused(certs: TestCerts) -> None:
    # TLS proves the certificate; the secret is still checked inside it
    async with WanReceiver(tls=server_tls(certs), secret=SECRET) as rx:
        err = await _refused(
            rx, {"secret": b"another-secret-0123456789abcdef", "tls": client_tls(certs)}
        )
        assert "proof" in str(err) or "rejected" in str(err)
        assert rx.statistics().auth_failures >= 1 and rx.statistics().tls_failures == 0


def test_bad_configuration_is_a_typed_error(certs: TestCerts, tmp_path: Path) -> None:
    with pytest.raises(LocalProtocolError, match="certificate"):
        WanReceiver(tls=TlsConfig())
    with pytest.raises(LocalProtocolError, match="CA"):
        WanReceiver(
            tls=TlsConfig(cert=certs.server_cert, key=certs.server_key, require_client_cert=True)
        )
    with pytest.raises(LocalProtocolError, match="TLS configuration"):
        WanSender("127.0.0.1:1", tls=TlsConfig(ca=str(tmp_path / "missing.pem")))
    with pytest.raises(PddnetError):
        WanReceiver(tls=TlsConfig(cert=certs.ca, key=certs.server_key))  # key does not match


async def test_auth_inside_tls_is_bound_to_the_tls_session(
    certs: TestCerts, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two ends that see different channel bindings (what a relay between two TLS
    # sessions would give) must fail the challenge-response though the secret is right.
    orig = ssl.SSLSocket.get_channel_binding

    def skewed(self: ssl.SSLSocket, cb_type: str = "tls-unique") -> bytes | None:
        b = orig(self, cb_type)
        return None if b is None else (b + b"relay" if self.server_side else b)

    monkeypatch.setattr(ssl.SSLSocket, "get_channel_binding", skewed)
    async with WanReceiver(tls=server_tls(certs), secret=SECRET) as rx:
        err = await _refused(rx, {"secret": SECRET, "tls": client_tls(certs)})
        assert "proof" in str(err) or "rejected" in str(err)
        assert rx.statistics().auth_failures >= 1 and rx.statistics().tls_failures == 0


async def test_tls_sender_refused_by_a_connection_bound_retries_not_auth_error(
    certs: TestCerts,
) -> None:
    # A connection refused by a bound is closed mid-handshake: with no stream up that
    # must be retried (PeerUnavailable), not end the transfer as an AuthError.
    from pddnet.transport.testing import make_case
    from pddnet.transport.wan import WanLimits

    case = make_case(12, 2 << 20, pieces=3)
    lim = WanLimits(max_connections_per_peer=2)
    async with WanReceiver(tls=server_tls(certs), secret=SECRET, limits=lim) as rx:
        host, port = rx.address.rsplit(":", 1)
        squatters = []
        for _ in range(2):  # silent connections hold both slots (handshake timeout 5 s)
            sq = tsocket.socket()
            await sq.connect((host, int(port)))
            squatters.append(sq)
        grant = rx.grant(case.dst, case.dst_ranges, timeout=K_BOUND_S)
        async with WanSender(
            rx.address, tls=client_tls(certs), secret=SECRET, streams=2, chunk_size=256 << 10
        ) as tx:
            with trio.fail_after(K_BOUND_S):
                transfer = tx.start(grant, case.src, case.src_ranges, timeout=K_BOUND_S)
                while rx.statistics().limit_rejections < 2:
                    await trio.sleep(0.01)
                assert transfer.error is None  # still running, retrying
                for sq in squatters:
                    sq.close()
                await transfer.wait()
                await rx.wait_transfer(grant.transfer_id)
            assert tx.auth_failures == 0
        case.check_complete()
