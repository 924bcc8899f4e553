"""``pddnet bench faults``: its accounting, on constructed episodes.

The episodes here are built by hand (no processes): P's journal as text, the
decoders' probe answers as dicts. What is checked is how the bench counts
them: every request of every episode, a killed P's included, ends in one
bucket, and a surviving decoder that stops answering makes the run fail.
The real episodes run in ``tests/test_reliability_faults.py``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pddnet.bench.faults import (
    K_KILLED_WITH_P,
    check_episode,
    journal_requests,
    passed,
    reference,
    totals,
)

PROMPT = [5, 9, 2, 7, 1, 3]


def _rec(rid: int, outcome: str | None, n: int = 4, **kw: Any) -> dict[str, Any]:
    """A request record as P journals it; a finished one has the reference tokens."""
    tokens = [[i, t] for i, t in enumerate(reference(PROMPT, n))] if outcome == "finished" else []
    return {
        "request_id": rid,
        "prompt": PROMPT,
        "max_tokens": n,
        "route": "p-md",
        "tokens": tokens,
        "outcome": outcome,
        "error": None,
        **kw,
    }


def _idle(active: int = 0) -> dict[str, Any]:
    """A decoder's probe answer: every block free."""
    return {"num_blocks": 64, "free_blocks": 64, "cache_blocks": 0, "active": active, "rss_kb": 1}


def _episode(fault: str, requests: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    p = {"held_blocks": 0, "free_blocks": 10, "baseline_free_blocks": 10, "rss_growth_kb": 0}
    return {
        "fault": fault,
        "requests": requests,
        "p": None if fault == "kill_p" else p,
        "decoders": {"relay": _idle(), "main": _idle()},
        "crashed": [],
        **kw,
    }


def _journal(*lines: dict[str, Any]) -> str:
    return "".join(json.dumps(rec) + "\n" for rec in lines)


def test_journal_keeps_each_requests_last_line() -> None:
    text = _journal(_rec(1, None), _rec(2, None), _rec(1, "finished"), _rec(2, "hung"))
    recs = {r["request_id"]: r["outcome"] for r in journal_requests(text, p_killed=False)}
    assert recs == {1: "finished", 2: "hung"}


def test_journal_of_a_killed_p_keeps_its_requests_in_flight() -> None:
    # 1 finished before the kill; 2 was in flight; 3's second line was cut short
    text = _journal(_rec(1, None), _rec(2, None), _rec(1, "finished"), _rec(3, None))
    text += json.dumps(_rec(3, "finished"))[:30]
    recs = {r["request_id"]: r["outcome"] for r in journal_requests(text, p_killed=True)}
    assert recs == {1: "finished", 2: K_KILLED_WITH_P, 3: K_KILLED_WITH_P}


def test_journal_without_a_kill_leaves_unfinished_requests_lost() -> None:
    recs = journal_requests(_journal(_rec(1, None)), p_killed=False)
    assert [r["outcome"] for r in recs] == [None]
    assert check_episode(_episode("none", recs))["lost"] == 1


def test_journal_rejects_a_malformed_line() -> None:
    text = "{not json\n" + _journal(_rec(1, "finished"))
    with pytest.raises(ValueError, match="line 1"):
        journal_requests(text, p_killed=True)


def test_a_kill_p_episode_counts_every_request() -> None:
    text = _journal(_rec(1, None), _rec(2, None), _rec(1, "finished"), _rec(3, "error"))
    res = check_episode(_episode("kill_p", journal_requests(text, p_killed=True)))
    assert res["requests"] == 3
    assert (res["completed"], res["typed_errors"], res["lost"], res["hung"]) == (1, 2, 0, 0)
    assert res["killed_with_p"] == 1 and res["errors"]["killed with P"] == 1
    assert res["corrupted"] == 0 and res["unaccounted"] == ["p (killed)"]
    summary = totals([res])
    assert summary["requests"] == 3 and summary["killed_with_p"] == 1
    assert passed(summary, [])


def test_a_decoder_still_serving_a_killed_ps_request_is_hung() -> None:
    recs = journal_requests(_journal(_rec(1, None)), p_killed=True)
    res = check_episode(_episode("kill_p", recs, decoders={"relay": _idle(1), "main": _idle()}))
    assert res["killed_with_p"] == 1 and res["hung"] == 1
    assert not passed(totals([res]), [])


@pytest.mark.parametrize(
    ("fault", "silent"), [("none", "relay"), ("kill_md", "relay"), ("kill_p", "main")]
)
def test_an_unreachable_survivor_is_hung_and_fails_the_run(fault: str, silent: str) -> None:
    decoders: dict[str, Any] = {"relay": _idle(), "main": _idle(), silent: None}
    if fault == "kill_md":
        decoders["main"] = None  # the killed decoder: its accounting died with it
    res = check_episode(_episode(fault, [_rec(1, "finished")], decoders=decoders))
    assert res["unreachable"] == [silent] and res["hung"] == 1
    assert ("main (killed)" in res["unaccounted"]) == (fault == "kill_md")
    summary = totals([res, check_episode(_episode("none", [_rec(2, "finished")]))])
    assert summary["unreachable_survivors"] == 1 and summary["hung"] == 1
    assert not passed(summary, [])


def test_the_killed_decoder_is_unaccounted_not_hung() -> None:
    ep = _episode("kill_rld", [_rec(1, "finished")], decoders={"relay": None, "main": _idle()})
    res = check_episode(ep)
    assert res["unaccounted"] == ["relay (killed)"] and res["unreachable"] == []
    assert res["hung"] == 0 and passed(totals([res]), [])


def test_a_clean_run_passes_and_a_failed_episode_does_not() -> None:
    summary = totals([check_episode(_episode("none", [_rec(1, "finished")]))])
    assert passed(summary, [])
    assert not passed(summary, ["episode 3 (kill_md): RuntimeError: P did not start"])
