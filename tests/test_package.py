"""Package surface: exports, lazy extras, the CLI."""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import pddnet
from pddnet import MissingExtraError
from pddnet._optional import require

ROOT = Path(__file__).resolve().parents[1]


def public_packages() -> list[str]:
    names = ["pddnet"]
    for mod in pkgutil.walk_packages(pddnet.__path__, "pddnet."):
        if mod.ispkg and not any(p.startswith("_") for p in mod.name.split(".")):
            names.append(mod.name)
    return names


@pytest.mark.parametrize("name", public_packages())
def test_every_public_package_declares_and_resolves_all(name: str) -> None:
    try:
        mod = importlib.import_module(name)
    except MissingExtraError:
        pytest.skip(f"{name} needs an extra")
    if name in ("pddnet.bench", "pddnet.cli"):
        return  # command namespaces, not APIs
    exported = getattr(mod, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    for attr in exported:
        assert hasattr(mod, attr), f"{name}.__all__ names missing {attr}"


def test_import_works_without_ucxx_or_cupy() -> None:
    code = (
        "import sys; sys.modules['ucxx'] = None; sys.modules['cupy'] = None\n"
        "import pddnet, pddnet.kv, pddnet.wire, pddnet.control\n"
        "from pddnet._optional import require\n"
        "from pddnet import MissingExtraError\n"
        "for mod, extra in [('ucxx', 'ucx'), ('cupy', 'gpu')]:\n"
        "    try:\n"
        "        require(mod)\n"
        "    except MissingExtraError as e:\n"
        "        assert f'pddnet[{extra}]' in str(e), e\n"
        "    else:\n"
        "        raise SystemExit('no error')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_require_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(MissingExtraError, match=r"pddnet\[gpu\]") as info:
        require("cupy")
    assert isinstance(info.value, ImportError) and info.value.extra == "gpu"


def test_cli_help_lists_subcommands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pddnet", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for cmd in ("demo", "bench", "wan"):
        assert cmd in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "pddnet", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    for bench in ("control", "kv"):
        assert bench in out.stdout


def test_bench_control_quick_writes_summary(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pddnet",
            "bench",
            "control",
            "--quick",
            "--iterations",
            "300",
            "--json",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(path.read_text())["summary"]
    assert summary["p50_rtt_us"] > 0 and summary["p99_rtt_us"] >= summary["p50_rtt_us"]
    assert summary["rtt_ratio_vs_raw_zmq"] > 0
