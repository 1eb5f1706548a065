"""A small cluster chaos run in the normal suite (`python -m bench.chaos --cluster` runs the
full one): three gateways, one Redis, one stub with 3 slots, and every kind of fault at least
once (a gateway killed, Redis paused, Redis restarted empty, the stub killed)."""

from __future__ import annotations

from pathlib import Path

from testsupport.chaos_cluster import run


def test_a_cluster_under_every_kind_of_fault_keeps_every_invariant(tmp_path: Path) -> None:
    report = run(n=150, concurrency=30, seed=3, workdir=tmp_path)
    assert len(report.faults) == 4, report.faults
    assert all(kind["count"] >= 1 for kind in report.faults.values()), report.faults
    assert report.unclean_endings == [], report.unclean_endings[:10]
    assert report.scenario_problems == [], report.scenario_problems[:10]
    assert report.stub["peak_in_flight"] <= 3, report.stub
    assert max(report.stub["its_own_max_in_flight_by_life"]) <= 3, report.stub
    assert report.stub["peak_in_flight_of_capped_client"] <= 1, report.stub
    assert report.outcomes.get("answered", 0) > 0 and report.outcomes.get("gateway killed", 0)
    assert not any(report.at_rest.values()), report.at_rest
    assert report.unhandled_errors == 0, f"tracebacks in the gateways' logs under {tmp_path}"
    assert report.exit_statuses == [0, 0, 0], f"a gateway did not stop: logs under {tmp_path}"
    failed = [name for name, held in report.invariants.items() if not held]
    assert not failed, failed
