"""``pddnet bench route``'s decision rate (issue 21): it routes over the
cluster it claims (4 RLD x 8 MD, the cached prefixes in the mirrors), with
both routes and every MD in use, and reports the rate it timed."""

from __future__ import annotations

from pddnet.bench.route import decision_rate


def test_decision_rate_routes_over_the_cluster_it_reports() -> None:
    summary, rows = decision_rate(prefixes=500, decisions=3000, reps=2)
    assert (summary["route_relays"], summary["route_mains"], summary["cached_prefixes"]) == (
        4,
        8,
        500,
    )
    # 500 prompts of 256-2048 tokens, 16 per block, a tenth on two MDs
    assert 500 * 16 <= summary["cached_keys"] <= 550 * 128
    assert len(rows) == 2
    for row in rows:
        assert row["p_md"] + row["p_rld_md"] == row["decisions"] == 3000
        assert row["p_md"] > row["p_rld_md"] > 0  # mostly high hits; misses relay
        assert row["mds_used"] == 8
        assert row["decisions_per_s"] == row["decisions"] / row["elapsed_s"]
    rates = sorted(r["decisions_per_s"] for r in rows)
    assert summary["decisions_per_s"] == sum(rates) / 2  # the median of two
    assert summary["decisions_per_s_min"] == rates[0]
    assert summary["chain_hash_us_mean"] > 0
