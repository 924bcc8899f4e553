"""Coverage-guided fuzzing of pddnet's decoders with atheris (optional, not in CI).

Usage (``make fuzz`` runs every target for a while)::

    python tests/fuzz_atheris.py TARGET [libFuzzer flags, e.g. -max_total_time=60]

TARGET is one of the ``tests/corpus/`` subdirectories (``chunk_header``,
``control_frame``, ``tokens``, ``endpoint_blob``, ``link_frame``,
``auth_frame``). The corpus directory seeds the run; libFuzzer writes new
interesting inputs to ``out/fuzz/TARGET/`` (add the useful ones to the corpus
with an ``ok-``/``bad-`` prefix). Any exception other than the decoder's typed
error, or a failed round-trip check, is a crash that libFuzzer saves.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import atheris  # type: ignore[import-untyped, import-not-found, unused-ignore]

with atheris.instrument_imports():
    from pddnet import PddnetError
    from pddnet.api import EndpointInfo
    from pddnet.transport.wan._framing import LinkFrame
    from pddnet.wire import ChunkHeader, decode_frame, decode_tokens, encode_tokens
    from pddnet.wire._auth import AuthFrame
    from pddnet.wire._control import K_TAG_SIZE, _tag

KEY = b"corpus-key-0123456789abcdef012345"  # as tests/corpus/_make.py
SRC, DST = "p0", "md0"


def _chunk(data: bytes) -> None:
    h = ChunkHeader.decode(data)
    assert h.encode() == data


def _frame(data: bytes) -> None:
    # half the inputs are re-tagged so that the fuzzer reaches the parser behind the MAC
    if data[:1] == b"\x00" and len(data) > K_TAG_SIZE:
        body = data[K_TAG_SIZE:]
        data = _tag(KEY, SRC, DST, body) + body
    decode_frame(data, key=KEY, src=SRC, dst=DST)


def _tokens(data: bytes) -> None:
    toks = decode_tokens(data, max_tokens=4096)
    assert (decode_tokens(encode_tokens(toks), 4096) == toks).all()


def _blob(data: bytes) -> None:
    info = EndpointInfo.from_blob(data)
    assert EndpointInfo.from_blob(info.blob()) == info


def _link(data: bytes) -> None:
    assert LinkFrame.decode(data).encode() == data


def _auth(data: bytes) -> None:
    assert AuthFrame.decode(data).encode() == data


TARGETS = {
    "chunk_header": _chunk,
    "control_frame": _frame,
    "tokens": _tokens,
    "endpoint_blob": _blob,
    "link_frame": _link,
    "auth_frame": _auth,
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(TARGETS)}}} [libFuzzer flags]")
    name = sys.argv[1]
    target = TARGETS[name]

    def one(data: bytes) -> None:
        with contextlib.suppress(PddnetError):
            target(data)

    out = Path("out/fuzz") / name
    out.mkdir(parents=True, exist_ok=True)
    corpus = Path(__file__).parent / "corpus" / name
    argv = [sys.argv[0], *sys.argv[2:], str(out), str(corpus)]
    os.environ.setdefault("PYTHONHASHSEED", "0")
    atheris.Setup(argv, one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
