"""Who says why the local path is TCP: each message only where it is true.

* the local-path factory warns that ucxx is missing only when ucxx does not
  import, and only when it opens a receiver (the side that chooses);
* a sender given a TCP address says nothing: the receiver chose TCP, maybe
  by configuration, with ucxx installed;
* ``RelayEndpoint``'s default receiver warns, with the real cause, when it
  falls back; a receiver the caller passes in, or UCX, draws no warning.
"""

from __future__ import annotations

import logging

import pytest

from pddnet._optional import available
from pddnet.api import ReferenceEngine, RelayEndpoint, _decode
from pddnet.recompute import TINY, ReferenceModel
from pddnet.transport.local import _fallback
from pddnet.transport.wan import WanReceiver, WanSender

KEY = b"a-fallback-test-secret-0123456789abcdef"
FACTORY = "ucxx is not installed (ucxx._lib.libucxx does not import): the local path"
RELAY = "relay rld: ucxx is not installed"
UCX = available("ucxx._lib.libucxx")


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "ucxx" in r.getMessage()]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(_fallback, "_warned", False)  # the factory warns once a process
    caplog.set_level(logging.DEBUG, logger="pddnet")


def test_factory_warns_when_ucxx_does_not_import(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh: None
) -> None:
    monkeypatch.setattr(_fallback, "local_available", lambda: False)
    assert isinstance(_fallback.open_local_receiver(), WanReceiver)
    assert [m for m in _messages(caplog) if m.startswith(FACTORY)] == _messages(caplog)
    assert len(_messages(caplog)) == 1


@pytest.mark.parametrize("ucx_imports", [True, False])
def test_a_sender_to_a_tcp_address_claims_nothing(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh: None,
    ucx_imports: bool,
) -> None:
    # the receiver chose TCP (the demo's --local-path tcp, with ucxx installed)
    monkeypatch.setattr(_fallback, "local_available", lambda: ucx_imports)
    assert isinstance(_fallback.open_local_sender("tcp://127.0.0.1:9", secret=KEY), WanSender)
    assert _messages(caplog) == []


@pytest.mark.skipif(not UCX, reason="ucxx is not installed")
def test_factory_with_ucxx_says_nothing(caplog: pytest.LogCaptureFixture, fresh: None) -> None:
    from pddnet.transport.local import UcxReceiver

    assert isinstance(_fallback.open_local_receiver(secret=KEY), UcxReceiver)
    assert _messages(caplog) == []


async def test_relay_fallback_warns_with_the_real_cause(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh: None
) -> None:
    monkeypatch.setattr(_decode, "local_available", lambda: False)
    model = ReferenceModel.create(TINY, 16)
    async with RelayEndpoint("rld", model.pool, ReferenceEngine(model), secret=KEY) as rld:
        assert isinstance(rld.receiver, WanReceiver)
        assert not rld.info().data.startswith("ucx:")
    (message,) = _messages(caplog)
    assert message.startswith(RELAY) and "takes TCP on 127.0.0.1" in message


@pytest.mark.parametrize("given", [True, False], ids=["receiver-given", "ucx"])
async def test_relay_says_nothing_when_it_did_not_fall_back(
    caplog: pytest.LogCaptureFixture, fresh: None, given: bool
) -> None:
    if not given and not UCX:
        pytest.skip("ucxx is not installed")
    model = ReferenceModel.create(TINY, 16)
    receiver = WanReceiver(host="127.0.0.1", secret=KEY) if given else None
    async with RelayEndpoint(
        "rld", model.pool, ReferenceEngine(model), secret=KEY, receiver=receiver
    ) as rld:
        assert rld.info().data.startswith("ucx:") is not given
    assert _messages(caplog) == []
