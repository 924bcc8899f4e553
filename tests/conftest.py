"""Shared pytest set-up: the emulator fixtures, and no silent vLLM skips in CI."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest_plugins = ["pddnet.emu._fixtures"]

# `make test` installs vLLM's CPU build (the `vllm` extra), so in CI (CI=true, as
# .ci/run is run) a vLLM test that skips means a broken install: fail it instead.
K_MUST_RUN_IN_CI = ("test_vllm_",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and os.environ.get("CI")
        and item.path.name.startswith(K_MUST_RUN_IN_CI)
        and "gpu" not in item.keywords
    ):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where `make test` installs vLLM: {report.longrepr}"
