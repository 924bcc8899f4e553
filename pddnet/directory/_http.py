"""A small HTTP/1.1 JSON client on trio and h11, for etcd's v3 JSON gateway.

h11 is sans-IO: this module only pumps bytes between a trio stream and an
``h11.Connection``. Each call opens its own connection (the directory's calls
are few: a registration, a keep-alive every third of the TTL, load updates),
so a restarted server needs no reconnect logic. Every size read is bounded
before it is buffered, and every OS or h11 error becomes a pddnet error here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import h11
import trio

from .._errors import LocalProtocolError, PeerUnavailable, RemoteProtocolError, TransferTimeout

__all__ = ["HttpAddress", "post_json", "post_stream"]

K_RECV = 65536


class HttpAddress:
    """``http://host:port`` parsed once.

    Raises:
        LocalProtocolError: for another scheme, or no host or port.
    """

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise LocalProtocolError(f"{url!r} is not an http://host:port address")
        self.url = url.rstrip("/")
        self.host = parts.hostname
        self.port = parts.port


class _Conn:
    """One HTTP/1.1 exchange; OS, trio and h11 errors leave it as pddnet errors."""

    def __init__(self, addr: HttpAddress, stream: trio.SocketStream, path: str) -> None:
        self.where = f"{addr.url}{path}"
        self.addr = addr
        self.stream = stream
        self.path = path
        self.h11 = h11.Connection(h11.CLIENT)
        self.eof = False

    def _lost(self, why: object) -> PeerUnavailable:
        return PeerUnavailable(f"{self.where}: connection lost: {why}", peer=self.addr.url)

    async def send_post(self, body: bytes) -> None:
        headers = [
            ("Host", f"{self.addr.host}:{self.addr.port}"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
        ]
        out = self.h11.send(h11.Request(method="POST", target=self.path, headers=headers))
        out = (out or b"") + (self.h11.send(h11.Data(data=body)) or b"")
        out += self.h11.send(h11.EndOfMessage()) or b""
        try:
            await self.stream.send_all(out)
        except (OSError, trio.BrokenResourceError) as exc:
            raise self._lost(exc) from exc

    async def next_event(self) -> Any:
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                if self.eof:  # closed mid-answer: a crash, not a bad server
                    raise self._lost("closed mid-answer") from exc
                raise RemoteProtocolError(
                    f"{self.where}: bad HTTP: {exc}", peer=self.addr.url
                ) from exc
            if event is not h11.NEED_DATA:
                return event
            try:
                data = await self.stream.receive_some(K_RECV)
            except (OSError, trio.BrokenResourceError) as exc:
                raise self._lost(exc) from exc
            self.eof = not data
            self.h11.receive_data(data)


@asynccontextmanager
async def _exchange(
    addr: HttpAddress, path: str, payload: dict[str, Any]
) -> AsyncIterator[tuple[int, _Conn]]:
    """POST ``payload`` and yield (status, connection) once the headers are in;
    the connection closes when the block ends."""
    try:
        stream = await trio.open_tcp_stream(addr.host, addr.port)
    except OSError as exc:
        raise PeerUnavailable(f"cannot connect to {addr.url}: {exc}", peer=addr.url) from exc
    async with stream:
        conn = _Conn(addr, stream, path)
        await conn.send_post(json.dumps(payload).encode())
        response = await conn.next_event()
        if not isinstance(response, h11.Response):
            raise RemoteProtocolError(f"{conn.where}: no HTTP response", peer=addr.url)
        yield response.status_code, conn


def _parse(where: str, data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise RemoteProtocolError(f"{where}: malformed JSON: {exc}", peer=where) from exc
    if not isinstance(obj, dict):
        raise RemoteProtocolError(f"{where}: JSON is not an object", peer=where)
    return obj


async def post_json(
    addr: HttpAddress, path: str, payload: dict[str, Any], *, timeout: float, max_bytes: int
) -> tuple[int, dict[str, Any]]:
    """POST ``payload`` as JSON and return (HTTP status, the JSON object answered).

    Cancellation closes the connection; whether the server acted on the
    request is then unknown.

    Raises:
        TransferTimeout: if the answer is not complete within ``timeout`` s.
        PeerUnavailable: if the server cannot be reached or drops the connection.
        RemoteProtocolError: if the answer is not HTTP, not a JSON object (an
            error status without one included), or longer than ``max_bytes``.
    """
    where = f"{addr.url}{path}"
    with trio.move_on_after(timeout):
        async with _exchange(addr, path, payload) as (status, conn):
            body = bytearray()
            while not isinstance(event := await conn.next_event(), h11.EndOfMessage):
                if isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > max_bytes:
                        raise RemoteProtocolError(
                            f"{where}: answer longer than {max_bytes} bytes", peer=addr.url
                        )
            if status != 200 and not body.lstrip().startswith(b"{"):
                text = bytes(body[:200]).decode(errors="replace")
                raise RemoteProtocolError(f"{where}: HTTP {status}: {text}", peer=addr.url)
            return status, _parse(where, bytes(body))
    raise TransferTimeout(f"{where} did not answer within {timeout:g}s", peer=addr.url)


@asynccontextmanager
async def post_stream(
    addr: HttpAddress, path: str, payload: dict[str, Any], *, timeout: float, max_line: int
) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
    """POST ``payload`` and yield an iterator over the newline-delimited JSON
    objects the server streams back (etcd's gateway streams a watch this way).

    The connect and the response headers must arrive within ``timeout``; the
    stream itself has no deadline. Leaving the block closes the connection.

    Raises:
        TransferTimeout: if the headers do not arrive within ``timeout`` s.
        PeerUnavailable: if the server cannot be reached, or the stream ends
            or breaks (from the iterator).
        RemoteProtocolError: for an HTTP error status, a line longer than
            ``max_line`` bytes, or a line that is not a JSON object.
    """
    where = f"{addr.url}{path}"
    async with AsyncExitStack() as stack:
        with trio.move_on_after(timeout) as scope:
            status, conn = await stack.enter_async_context(_exchange(addr, path, payload))
        if scope.cancelled_caught:
            raise TransferTimeout(f"{where} did not answer within {timeout:g}s", peer=addr.url)
        if status != 200:
            raise RemoteProtocolError(f"{where}: HTTP {status}", peer=addr.url)
        yield _lines(conn, max_line)


async def _lines(conn: _Conn, max_line: int) -> AsyncIterator[dict[str, Any]]:
    buf = bytearray()
    while True:
        event = await conn.next_event()
        if not isinstance(event, h11.Data):
            raise PeerUnavailable(f"{conn.where}: the stream ended", peer=conn.addr.url)
        buf += event.data
        *complete, rest = bytes(buf).split(b"\n")
        if len(rest) > max_line:
            raise RemoteProtocolError(
                f"{conn.where}: a line longer than {max_line} bytes", peer=conn.addr.url
            )
        buf = bytearray(rest)
        for line in complete:
            if line.strip():
                yield _parse(conn.where, line)
