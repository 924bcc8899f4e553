"""Benchmarks behind ``pddnet bench NAME``: one module per benchmark.

Each module exposes ``add_arguments(parser)`` and ``main(args) -> int`` and
accepts ``--quick`` (under a minute here) and ``--json PATH`` (writes
``{"summary": {...}, ...}``); see :mod:`pddnet.bench._common`.
"""
