"""A small chaos run in the normal suite (`python -m bench.chaos` runs the 2,000-request one;
the run itself is testsupport/chaos.py): one model over two replicas, one of which dies and
comes back during the load, with config reloads, and a SIGTERM drain under load at the end."""

from __future__ import annotations

from pathlib import Path

from testsupport.chaos import ENDLESS_BOUND, run


def test_a_hundred_chaotic_requests_leak_nothing(tmp_path: Path) -> None:
    report = run(n=120, concurrency=30, seed=7, workdir=tmp_path)
    assert report["problems"] == [], report["problems"][:10]
    assert report["unhandled_errors"] == 0
    assert report["after"]["slots_in_use"] == 0 and report["after"]["waiting"] == 0
    assert report["after"]["stub_in_flight"] == 0 and report["after"]["healthz"] == 200
    assert report["after"]["stub_held_open"] == 0, "a body left open after [DONE] stayed open"
    assert report["after"]["stub_hangups"] <= report["hangups_sent"], "a request went twice"
    assert 0 < report["after"]["stub_endless_bytes"] <= ENDLESS_BOUND
    assert report["outages"] >= 2, "the replica died and came back more than once"
    assert report["after"]["served_after_revival"] > 0, "a revived replica took requests"
    assert report["retries"].get("connect", 0) > 0, "requests met the dead replica, went on"
    reloads = report["reloads"]
    assert reloads["valid"] > 0 and reloads["invalid"] > 0, reloads
    assert (reloads["applied"], reloads["refused"]) == (reloads["valid"], reloads["invalid"])
    assert report["exit_status"] == 0
    assert report["drain"]["ok"], report["drain"]
    assert report["ok"]
