"""Link specifications and the unit parsers behind ``--rtt 30ms --rate 1gbit --loss 0.1%``."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from .._errors import LocalProtocolError

__all__ = [
    "GilbertElliott",
    "LinkSpec",
    "WanSpec",
    "parse_bytes",
    "parse_duration",
    "parse_fraction",
    "parse_rate",
]

_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_DUR_UNITS = {"": 1e-3, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_RATE_UNITS = {
    "": 1.0,
    "bit": 1.0,
    "bps": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
}
_BYTE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1 << 20, "mb": 1 << 20}


def _split(text: str, what: str) -> tuple[float, str]:
    m = re.fullmatch(_NUM + r"\s*([a-zA-Z%]*)", text.strip())
    if not m:
        raise LocalProtocolError(f"can't parse {what} {text!r}")
    return float(m.group(1)), m.group(2).lower()


def parse_duration(text: str | float) -> float:
    """Parse ``"30ms"``, ``"2us"``, ``"0.5s"`` (a bare number means ms) into seconds.

    Args:
        text: the duration, or a float already in seconds.

    Returns:
        Seconds.

    Raises:
        LocalProtocolError: the text is not a duration.
    """
    if isinstance(text, int | float):
        return float(text)
    value, unit = _split(text, "duration")
    if unit not in _DUR_UNITS:
        raise LocalProtocolError(f"unknown duration unit in {text!r}")
    return value * _DUR_UNITS[unit]


def parse_rate(text: str | float | None) -> float | None:
    """Parse ``"1gbit"``, ``"200mbit"`` (tc spelling) into bits per second.

    Args:
        text: the rate; ``None``, ``0`` or ``"0"`` mean unlimited.

    Returns:
        Bits per second, or ``None`` for unlimited.

    Raises:
        LocalProtocolError: the text is not a rate.
    """
    if text is None:
        return None
    if isinstance(text, int | float):
        return float(text) or None
    value, unit = _split(text, "rate")
    if unit not in _RATE_UNITS:
        raise LocalProtocolError(f"unknown rate unit in {text!r}")
    return value * _RATE_UNITS[unit] or None


def parse_fraction(text: str | float) -> float:
    """Parse ``"0.1%"`` or ``0.001`` into a probability.

    Args:
        text: a percentage (with ``%``) or a fraction.

    Returns:
        A probability in [0, 1].

    Raises:
        LocalProtocolError: not a probability.
    """
    if isinstance(text, int | float):
        value = float(text)
    else:
        value, unit = _split(text, "probability")
        if unit == "%":
            value /= 100.0
        elif unit:
            raise LocalProtocolError(f"unknown unit in probability {text!r}")
    if not 0.0 <= value <= 1.0:
        raise LocalProtocolError(f"probability {text!r} outside [0, 1]")
    return value


def parse_bytes(text: str | int) -> int:
    """Parse ``"4mb"``, ``"64k"``, ``9000`` into bytes.

    Args:
        text: a byte count.

    Returns:
        Bytes.

    Raises:
        LocalProtocolError: not a byte count.
    """
    if isinstance(text, int):
        return text
    value, unit = _split(text, "size")
    if unit not in _BYTE_UNITS:
        raise LocalProtocolError(f"unknown size unit in {text!r}")
    return int(value * _BYTE_UNITS[unit])


@dataclass(frozen=True, slots=True)
class GilbertElliott:
    """Two-state bursty loss (Gilbert-Elliott), as in netem's ``loss gemodel``.

    Per packet the chain first moves (good->bad with ``p``, bad->good with ``r``),
    then the packet is lost with ``loss_good`` or ``loss_bad``.
    """

    p: float
    r: float
    loss_bad: float = 1.0
    loss_good: float = 0.0

    def mean_loss(self) -> float:
        """Stationary loss probability."""
        bad = self.p / (self.p + self.r) if self.p + self.r > 0 else 0.0
        return bad * self.loss_bad + (1.0 - bad) * self.loss_good


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One direction of the emulated WAN.

    Attributes:
        delay: one-way delay in seconds.
        jitter: standard deviation of a normal delay variation (truncated at 3 sigma).
        loss: independent random loss probability, applied on the wire after the queue.
        ge: optional Gilbert-Elliott bursty loss, applied in addition to ``loss``.
        rate: bottleneck rate in bits/s of IP packets; ``None`` is unlimited.
        queue_bytes: drop-tail limit of the bottleneck queue; ``None`` is about one BDP.
        reorder: probability that a packet skips the delay line (arrives early).
        allow_reorder: let jitter reorder packets (off: delivery times never decrease).
        seed: seed of this direction's random stream, so runs reproduce.
    """

    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0
    ge: GilbertElliott | None = None
    rate: float | None = None
    queue_bytes: int | None = None
    reorder: float = 0.0
    allow_reorder: bool = False
    seed: int = 1

    def effective_queue_bytes(self, rtt: float | None = None) -> int:
        """The drop-tail limit: ``queue_bytes`` or one BDP (rate x rtt), at least 64 KiB."""
        if self.queue_bytes is not None:
            return self.queue_bytes
        if self.rate is None:
            return 1 << 30
        rtt = 2 * self.delay if rtt is None else rtt
        return max(int(self.rate * rtt / 8), 64 * 1024)

    def mean_loss(self) -> float:
        """Expected loss probability of this direction (random and bursty combined)."""
        ge = self.ge.mean_loss() if self.ge else 0.0
        return 1.0 - (1.0 - self.loss) * (1.0 - ge)

    def to_dict(self) -> dict[str, object]:
        """A JSON-friendly dict; :meth:`from_dict` inverts it."""
        d: dict[str, object] = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "ge"
        }
        d["ge"] = (
            None if self.ge is None else [self.ge.p, self.ge.r, self.ge.loss_bad, self.ge.loss_good]
        )
        return d

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> LinkSpec:
        """Inverse of :meth:`to_dict`."""
        kw = dict(d)
        ge = kw.pop("ge", None)
        return cls(**kw, ge=None if ge is None else GilbertElliott(*ge))  # type: ignore[arg-type, misc]


@dataclass(frozen=True, slots=True)
class WanSpec:
    """The whole emulated WAN: the two directions, the MTU and host TCP settings.

    Attributes:
        a_to_b: DC-A -> DC-B direction.
        b_to_a: DC-B -> DC-A direction.
        mtu: MTU of every link in the testbed (loss-sensitive results depend on it).
        tcp_mem_max: ``tcp_rmem``/``tcp_wmem`` maximum set in every host namespace.
        congestion_control: TCP congestion control of the hosts; ``None`` keeps the
            kernel's default (a namespace may only pick one from
            ``net.ipv4.tcp_allowed_congestion_control``).
    """

    a_to_b: LinkSpec = field(default_factory=LinkSpec)
    b_to_a: LinkSpec = field(default_factory=LinkSpec)
    mtu: int = 1500
    tcp_mem_max: int = 64 << 20
    congestion_control: str | None = None

    @property
    def rtt(self) -> float:
        """Configured base round-trip time in seconds (both one-way delays)."""
        return self.a_to_b.delay + self.b_to_a.delay

    @classmethod
    def symmetric(
        cls,
        *,
        rtt: str | float = "0ms",
        jitter: str | float = "0ms",
        loss: str | float = 0.0,
        rate: str | float | None = None,
        mtu: int = 1500,
        queue: str | int | None = None,
        reorder: str | float = 0.0,
        ge: GilbertElliott | None = None,
        seed: int = 1,
        congestion_control: str | None = None,
        tcp_mem_max: int = 64 << 20,
    ) -> WanSpec:
        """Build a WAN whose two directions share the parameters (half the RTT each).

        Args:
            rtt: base round-trip time (``"30ms"`` or seconds).
            jitter: per-direction delay standard deviation.
            loss: per-direction random loss (``"0.1%"`` or a fraction).
            rate: per-direction bottleneck rate (``"1gbit"`` or bits/s), ``None`` unlimited.
            mtu: MTU of every link.
            queue: drop-tail limit in bytes (``"4mb"``); default about one BDP.
            reorder: probability a packet skips the delay line.
            ge: optional Gilbert-Elliott loss in each direction.
            seed: base seed; the directions get ``seed`` and ``seed + 1``.
            congestion_control: host TCP congestion control.
            tcp_mem_max: host socket buffer autotuning maximum.

        Returns:
            The spec.

        Raises:
            LocalProtocolError: a value does not parse.
        """
        one_way = parse_duration(rtt) / 2
        kw = dict(
            delay=one_way,
            jitter=parse_duration(jitter),
            loss=parse_fraction(loss),
            ge=ge,
            rate=parse_rate(rate),
            queue_bytes=None if queue is None else parse_bytes(queue),
            reorder=parse_fraction(reorder),
        )
        if mtu < 576 or mtu > 65000:
            raise LocalProtocolError(f"mtu {mtu} outside [576, 65000]")
        return cls(
            a_to_b=LinkSpec(**kw, seed=seed),  # type: ignore[arg-type]
            b_to_a=LinkSpec(**kw, seed=seed + 1),  # type: ignore[arg-type]
            mtu=mtu,
            tcp_mem_max=tcp_mem_max,
            congestion_control=congestion_control,
        )

    def to_dict(self) -> dict[str, object]:
        """A JSON-friendly dict; :meth:`from_dict` inverts it."""
        return {
            "a_to_b": self.a_to_b.to_dict(),
            "b_to_a": self.b_to_a.to_dict(),
            "mtu": self.mtu,
            "tcp_mem_max": self.tcp_mem_max,
            "congestion_control": self.congestion_control,
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> WanSpec:
        """Inverse of :meth:`to_dict`."""
        return cls(
            a_to_b=LinkSpec.from_dict(d["a_to_b"]),  # type: ignore[arg-type]
            b_to_a=LinkSpec.from_dict(d["b_to_a"]),  # type: ignore[arg-type]
            mtu=int(d["mtu"]),  # type: ignore[call-overload]
            tcp_mem_max=int(d["tcp_mem_max"]),  # type: ignore[call-overload]
            congestion_control=d.get("congestion_control"),  # type: ignore[arg-type]
        )
