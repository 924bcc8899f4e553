"""The compiled part of pddnet: the WAN data path's native mover (optional).

Everything else is in pyproject.toml. The extension is optional: where it does
not build (no C compiler or Python headers), pip still installs pddnet and the
WAN path runs its pure-Python loop (``pddnet.transport.wan.native_path()``
says which is in use).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pddnet.transport.wan._mover",
            sources=["pddnet/transport/wan/_mover.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
