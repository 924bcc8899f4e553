"""The two processes of :func:`~pddnet.transport.local.probe_local_path`.

``python -m pddnet.transport.local._probe_child receiver NBYTES TIMEOUT`` prints
its grant, waits for the transfer and prints whether it arrived intact;
``... sender GRANT TIMEOUT`` sends it and prints its time and the UCX
transports of its endpoint. Lines for the parent start with ``@@``; a failure
is the last line on stderr. Not imported by the package (``-m`` would run a
second copy).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from ._probe import K_MARK, K_SECRET_ENV


def _pattern(n: int) -> Any:
    import numpy as np

    return (np.arange(n) % 251).astype(np.uint8)


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(K_MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _receiver(nbytes: int, timeout: float) -> None:
    import numpy as np

    from ...kv import ByteRanges
    from ._receiver import UcxReceiver

    secret = os.environ[K_SECRET_ENV].encode()
    async with UcxReceiver(secret=secret, cma=False) as rx:
        buf = np.zeros(nbytes, np.uint8)
        g = rx.grant([buf], ByteRanges.build([0], [0], [nbytes], [0]), timeout=timeout)
        _say({"grant": [g.transfer_id, g.total, g.address]})
        await rx.wait_transfer(g.transfer_id)
        _say({"intact": bool(np.array_equal(buf, _pattern(nbytes)))})


async def _sender(grant: str, timeout: float) -> None:
    from ...kv import ByteRanges
    from .._base import Grant
    from ._sender import UcxSender

    tid, total, address = json.loads(grant)
    secret = os.environ[K_SECRET_ENV].encode()
    async with UcxSender(address, secret=secret) as tx:
        t0 = time.perf_counter()
        ranges = ByteRanges.build([0], [0], [total], [0])
        await tx.send(Grant(tid, total, (), address), [_pattern(total)], ranges, timeout=timeout)
        dt = time.perf_counter() - t0
        _say({"seconds": dt, "transports": tx.transports(), "tls": tx._service.worker.tls})


def _main(argv: list[str]) -> None:
    import trio

    role, arg, timeout = argv[0], argv[1], float(argv[2])
    code = 0
    try:
        if role == "receiver":
            trio.run(_receiver, int(arg), timeout)
        else:
            trio.run(_sender, arg, timeout)
    except BaseException as exc:  # reported on stderr: the parent's reason
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # UCX can hang in interpreter teardown (docs/local.md)


if __name__ == "__main__":
    _main(sys.argv[1:])
