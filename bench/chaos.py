"""The chaos runs at full size: `python -m bench.chaos` (testsupport/chaos.py: 2,000 requests
over two stub replicas, one of which dies and comes back) and `python -m bench.chaos --cluster
[--sentinel]` (testsupport/chaos_cluster.py: three gateways sharing one Redis, under gateway,
Redis and upstream faults). The suite runs small ones (tests/test_chaos.py,
tests/test_chaos_cluster.py); the runs themselves live in testsupport/, which both use.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from bench.scenarios import RESULTS
from testsupport import chaos, chaos_cluster


def cluster(requests: int, concurrency: int, seed: int, sentinel: bool) -> bool:
    """The run in a temporary directory; its report in bench/results/, and on a failure every
    process's log beside it."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        report: chaos_cluster.Report | None = None
        try:
            report = chaos_cluster.run(requests, concurrency, seed, workdir, sentinel)
        finally:
            if report is None or not report.ok:
                kept = RESULTS / f"chaos-cluster-{stamp}"
                shutil.copytree(workdir, kept)
                print(f"logs kept in {kept}", file=sys.stderr)
    text = json.dumps(asdict(report), indent=2)
    (RESULTS / f"chaos-cluster-{stamp}.json").write_text(text)
    print(text)
    for name, held in report.invariants.items():
        print(f"{'pass' if held else 'FAIL'}  {name}")
    print(f"results: bench/results/chaos-cluster-{stamp}.json")
    return report.ok


def main() -> None:
    parser = argparse.ArgumentParser(description=chaos.__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=None, help="60; 40 with --cluster")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="three gateways sharing one Redis, with gateway, Redis and upstream faults "
        "(testsupport/chaos_cluster.py)",
    )
    parser.add_argument(
        "--sentinel",
        action="store_true",
        help="with --cluster: Redis is a primary and a replica under Sentinel, whose faults "
        "are failovers",
    )
    args = parser.parse_args()
    if args.sentinel and not args.cluster:
        parser.error("--sentinel goes with --cluster")
    if args.cluster:
        ok = cluster(args.requests, args.concurrency or 40, args.seed, args.sentinel)
        sys.exit(0 if ok else 1)
    with tempfile.TemporaryDirectory() as workdir:
        report = chaos.run(args.requests, args.concurrency or 60, args.seed, Path(workdir))
    print(json.dumps(report, indent=2))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
