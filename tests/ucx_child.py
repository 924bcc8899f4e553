"""Code shared by the child processes of the UCX tests (``python -c SCRIPT``).

A child ends with ``os._exit``: ucxx (like NIXL) can crash in its interpreter-
exit teardown, which would turn a passing child into a failing one.
"""

import os
import subprocess
import sys
import textwrap

# The children's UCX over tcp only, as between two hosts.
TCP_ENV = {**os.environ, "UCX_TLS": "tcp,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def run_child(script: str, env: dict[str, str] = TCP_ENV, timeout: float = 120) -> str:
    """Run ``script`` (dedented) as ``python -c``; its stdout (asserts it exited 0)."""
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


# Run ``main`` and leave with its outcome as the exit status (1 with a traceback).
RUN_MAIN = """
try:
    trio.run(main)
except BaseException:
    import traceback; traceback.print_exc(); sys.stderr.flush(); os._exit(1)
os._exit(0)
"""

# Two children that meet through files in the directory D: put(name, text) publishes
# atomically, await get(name) waits for it; finish(fn) runs fn as RUN_MAIN runs main;
# grant_text(g) / grant_of(text) carry a Grant between them (json and Grant imported).
FILES = """
def grant_text(g):
    return json.dumps([g.transfer_id, g.total, list(g.layer_ends), g.address])

def grant_of(text):
    tid, total, ends, address = json.loads(text)
    return Grant(tid, total, tuple(ends), address)

def put(name, text):
    with open(os.path.join(D, name + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(D, name + ".tmp"), os.path.join(D, name))

async def get(name, timeout=30.0):
    with trio.fail_after(timeout):
        while not os.path.exists(os.path.join(D, name)):
            await trio.sleep(0.001)
    with open(os.path.join(D, name)) as f:
        return f.read()

def finish(fn):
    try:
        trio.run(fn)
    except BaseException:
        import traceback; traceback.print_exc(); sys.stderr.flush(); os._exit(1)
    os._exit(0)
"""
