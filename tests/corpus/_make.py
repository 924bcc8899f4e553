"""Regenerate the decoder fuzz corpus: ``python tests/corpus/_make.py``.

Each subdirectory holds seeds for one decoder. ``ok-*`` files must decode;
``bad-*`` files must raise the decoder's typed error. Files found by fuzzing
(Hypothesis or atheris) are added by hand with a ``bad-`` or ``ok-`` prefix
and a name saying what they exercise; this script never deletes them.
Control frames are tagged with ``KEY`` from ``src`` to ``dst`` below.
"""

from __future__ import annotations

from pathlib import Path

import msgpack

from pddnet.api import EndpointInfo
from pddnet.kv import KVLayout
from pddnet.transport.wan._framing import LinkCode, LinkFrame, LinkKind
from pddnet.wire import ChecksumAlgo, ChunkHeader, Hello, Ping, encode_frame, encode_tokens
from pddnet.wire._auth import AuthFrame, AuthKind
from pddnet.wire._control import _tag

KEY = b"corpus-key-0123456789abcdef012345"
SRC, DST = "p0", "md0"
HERE = Path(__file__).parent


def _tagged(body: bytes) -> bytes:
    return _tag(KEY, SRC, DST, body) + body


def seeds() -> dict[str, dict[str, bytes]]:
    hdr = ChunkHeader(7, 4096, 1024, 0xDEADBEEF, ChecksumAlgo.CRC32C).encode()
    hdr_bad_crc = hdr[:-1] + bytes([hdr[-1] ^ 1])
    ping = encode_frame(Ping(b"hi"), key=KEY, src=SRC, dst=DST, seq=1)
    hello = encode_frame(Hello("p0", 1, b"\x00" * 8), key=KEY, src=SRC, dst=DST, seq=2)
    layout = KVLayout(4, 2, 16, 16, "float32")
    info = EndpointInfo(
        "md0", "main", "e", 0, "tcp://10.0.0.2:5552", "10.0.0.2:6000", layout, "tiny@1"
    )
    blob = info.blob()
    return {
        "chunk_header": {
            "ok-basic.bin": hdr,
            "ok-xxh3.bin": ChunkHeader(1, 0, 1, 5, ChecksumAlgo.XXH3_64).encode(),
            "bad-crc.bin": hdr_bad_crc,
            "bad-short.bin": hdr[:39],
            "bad-empty.bin": b"",
            "bad-link-magic.bin": LinkFrame(LinkKind.ACK, 1).encode(),
        },
        "control_frame": {
            "ok-ping.bin": ping,
            "ok-hello.bin": hello,
            "bad-tampered.bin": ping[:-1] + b"\x00",
            "bad-short.bin": ping[:16],
            "bad-not-array.bin": _tagged(msgpack.packb({"a": 1})),
            "bad-unknown-type.bin": _tagged(msgpack.packb([1, 250, 0, 1, 0])),
            "bad-schema.bin": _tagged(msgpack.packb([1, 0, 0, 1, 0, "str-not-bytes"])),
            "bad-ext.bin": _tagged(b"\x95\x01\x00\x00\x01\xd4\x05\x00"),
            "bad-huge-array-claim.bin": _tagged(b"\xdd\xff\xff\xff\xff"),
            "bad-version.bin": _tagged(msgpack.packb([9, 0, 0, 1, 0, b""])),
            "bad-negative-seq.bin": _tagged(msgpack.packb([1, 0, 0, -1, 0, b""])),
        },
        "tokens": {
            "ok-small.bin": encode_tokens([0, 1, 127, 128, 300]),
            "ok-max.bin": encode_tokens([2**32 - 1]),
            "ok-empty.bin": b"",
            "bad-truncated.bin": b"\x80",
            "bad-six-bytes.bin": b"\x80\x80\x80\x80\x80\x01",
            "bad-over-u32.bin": b"\xff\xff\xff\xff\x7f",
        },
        "endpoint_blob": {
            "ok-main.bin": blob,
            "bad-truncated.bin": blob[:-3],
            "bad-role.bin": msgpack.packb([2, "x", "king", "e", 0, "c", "d", layout.to_dict(), ""]),
            "bad-layout.bin": msgpack.packb([2, "x", "main", "e", 0, "c", "d", {"x": 1}, ""]),
            "bad-bin-field.bin": msgpack.packb([2, b"x", "main", "e", 0, "c", "d", {}, ""]),
            "bad-model-type.bin": msgpack.packb([2, "x", "main", "e", 0, "c", "d", {}, 7]),
            "bad-version-1.bin": msgpack.packb(
                [1, "x", "main", "e", 0, "c", "d", layout.to_dict()]
            ),
            "bad-oversize.bin": b"\x90" * 5000,
        },
        "link_frame": {
            "ok-ack.bin": LinkFrame(LinkKind.ACK, 3, 4096, 1024).encode(),
            "ok-fail.bin": LinkFrame(LinkKind.FAIL, 3, code=LinkCode.CHECKSUM).encode(),
            "bad-chunk-magic.bin": hdr,
            "bad-kind.bin": _relink(LinkFrame(LinkKind.ACK, 3).encode(), 5, 99),
            "bad-code.bin": _relink(LinkFrame(LinkKind.ACK, 3).encode(), 6, 99),
            "bad-reserved.bin": _relink(LinkFrame(LinkKind.ACK, 3).encode(), 7, 1),
            "bad-short.bin": LinkFrame(LinkKind.ACK, 3).encode()[:20],
        },
        "auth_frame": {
            "ok-challenge.bin": AuthFrame(AuthKind.CHALLENGE, bytes(range(32))).encode(),
            "ok-fail.bin": AuthFrame(AuthKind.FAIL).encode(),
            "bad-chunk-magic.bin": hdr,
            "bad-kind.bin": b"PDDA\x01\x07\x00\x00" + bytes(32),
            "bad-reserved.bin": b"PDDA\x01\x01\x00\x01" + bytes(32),
            "bad-short.bin": b"PDDA\x01\x01",
        },
    }


def _relink(frame: bytes, pos: int, value: int) -> bytes:
    """Change one byte of a link frame and fix its CRC, to reach the field checks."""
    from crc32c import crc32c

    head = bytearray(frame[:36])
    head[pos] = value
    return bytes(head) + crc32c(bytes(head)).to_bytes(4, "little")


def main() -> None:
    for name, files in seeds().items():
        d = HERE / name
        d.mkdir(exist_ok=True)
        for fname, data in files.items():
            (d / fname).write_bytes(data)


if __name__ == "__main__":
    main()
