"""``python -m pddnet.emu._call``: run a pickled ``(module, qualname, args, kwargs)`` call.

Used by :meth:`pddnet.emu.Host.call`; the reply ``(ok, value_or_traceback)`` is
pickled to stdout.
"""

from __future__ import annotations

import importlib
import pickle
import sys
import traceback
from typing import Any


def main() -> int:
    """Read the call from stdin, run it, write the pickled outcome to stdout."""
    module, qualname, args, kwargs = pickle.loads(sys.stdin.buffer.read())
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        out: tuple[bool, Any] = (True, obj(*args, **kwargs))
    except BaseException as exc:
        out = (False, (type(exc).__name__, traceback.format_exc()))
    sys.stdout.buffer.write(pickle.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
