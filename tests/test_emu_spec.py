"""Unit parsing and spec round-trips."""

from __future__ import annotations

import pytest

import pddnet.emu as emu
from pddnet import LocalProtocolError
from pddnet.emu import GilbertElliott, LinkSpec, WanSpec
from pddnet.emu._testbed import netem_args


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30ms", 0.030), ("2us", 2e-6), ("0.5s", 0.5), ("15", 0.015), (0.02, 0.02)],
)
def test_parse_duration(text: str | float, seconds: float) -> None:
    assert emu.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "bps"), [("1gbit", 1e9), ("200mbit", 2e8), ("10kbit", 1e4), ("0", None), (None, None)]
)
def test_parse_rate(text: str | None, bps: float | None) -> None:
    assert emu.parse_rate(text) == bps


def test_parse_fraction_and_bytes() -> None:
    assert emu.parse_fraction("0.1%") == pytest.approx(0.001)
    assert emu.parse_fraction(0.25) == 0.25
    assert emu.parse_bytes("4mb") == 4 << 20
    for bad in ("150%", "-1", "x"):
        with pytest.raises(LocalProtocolError):
            emu.parse_fraction(bad)
    with pytest.raises(LocalProtocolError):
        emu.parse_duration("3 parsecs")
    with pytest.raises(LocalProtocolError):
        emu.parse_rate("1zbit")


def test_symmetric_spec_and_round_trip() -> None:
    spec = WanSpec.symmetric(
        rtt="30ms", loss="1%", rate="1gbit", mtu=9000, ge=GilbertElliott(0.01, 0.3), seed=4
    )
    assert spec.rtt == pytest.approx(0.030)
    assert spec.a_to_b.delay == pytest.approx(0.015)
    assert (spec.a_to_b.seed, spec.b_to_a.seed) == (4, 5)
    assert WanSpec.from_dict(spec.to_dict()) == spec
    assert spec.a_to_b.mean_loss() == pytest.approx(1 - 0.99 * (1 - 0.01 / 0.31))
    with pytest.raises(LocalProtocolError):
        WanSpec.symmetric(mtu=100)


def test_netem_args() -> None:
    link = LinkSpec(delay=0.015, jitter=0.002, loss=0.001, rate=1e9)
    args = netem_args(link, 9000, 0.030)
    assert args[:5] == ["delay", "15000us", "2000us", "distribution", "normal"]
    assert args[args.index("loss") + 1 : args.index("loss") + 3] == ["random", "0.100000%"]
    assert args[args.index("rate") + 1] == "1000000000bit"
    assert int(args[args.index("limit") + 1]) >= (3_750_000 + 1e9 * 0.021 / 8) / 9000
    # Random loss folds into the Gilbert-Elliott per-state loss (netem has one model).
    ge = LinkSpec(loss=0.1, ge=GilbertElliott(p=0.01, r=0.5, loss_bad=0.5, loss_good=0.0))
    args = netem_args(ge, 1500, 0.0)
    i = args.index("gemodel")
    assert args[i + 1 : i + 5] == ["1.000000%", "50.000000%", "55.000000%", "10.000000%"]
    assert "random" not in args


def test_exports() -> None:
    for name in emu.__all__:
        assert hasattr(emu, name), name
