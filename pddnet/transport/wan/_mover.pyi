# Types of the compiled mover (_mover.c; see its header comment).
from collections.abc import Sequence
from typing import Any as Buffer

PENDING: int
DONE: int
EOF: int

class Mover:
    def __init__(self) -> None: ...
    def send(
        self,
        fd: int,
        buffers: Sequence[Buffer],
        token: int,
        digest: Xxh3 | None = None,
        hash_from: int = 0,
        room: bool = False,
        /,
    ) -> tuple[int, int, int]: ...
    def recv(
        self,
        fd: int,
        buffer: Buffer,
        token: int,
        lowat: int,
        lowat_cap: int,
        digest: Xxh3 | None = None,
        /,
    ) -> tuple[int, int, int]: ...
    def cancel(self, token: int, /) -> tuple[int, int] | None: ...
    def cancel_fd(self, fd: int, /) -> list[int]: ...
    def completions(self) -> list[tuple[int, int, int, int]]: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...

class Xxh3:
    def __init__(self) -> None: ...
    def update(self, data: Buffer, /) -> None: ...
    def intdigest(self) -> int: ...

def bind_xxh3(path: str, /) -> bool: ...
