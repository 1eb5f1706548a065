"""Two gateway installs side by side: scenarios 1 and 2 through each, alternating, same stubs.

`python -m bench.pair TWISTD_A TWISTD_B [--rounds 4]` starts bench's fast and big stubs once
and a gateway from each `twistd` (two venvs, e.g. one with an older commit installed by
`pip install --no-deps`), then runs, round by round and in alternating order, one round of
scenario 1 (8 x 10,000-token streams, ratio to the direct stub and the gateway's CPU per 1,000
tokens) and scenario 2 (200 short requests, added time to first token and CPU per request)
through each. A single bench run moves with the machine between sessions by more than most
changes do; pairs run minutes apart on the same stubs compare. Both gateways get bench's own
config, so the older install must accept it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import testsupport.processes as processes
from bench.scenarios import ProcessStats, config, latency, throughput

FIGURES = ("ratio", "cpu_ms_per_1000_tokens", "added_p50_ms", "direct_p50_ms", "cpu_ms_per_request")


def one_round(url: str, stats: ProcessStats, fast: str, big: str) -> dict[str, Any]:
    streams = asyncio.run(throughput(big, url + "/llm", "bulk", 1, stats))
    short = asyncio.run(latency(fast, url + "/llm", "fast", 200, stats))
    return {
        "ratio": streams["ratio"],
        "cpu_ms_per_1000_tokens": streams["gateway_cpu_ms_per_1000_tokens"],
        "added_p50_ms": short["added_p50_ms"],
        "direct_p50_ms": short["direct_p50_ms"],
        "cpu_ms_per_request": short["gateway_cpu_ms_per_request"],
    }


def run(twistds: list[str], rounds: int, workdir: Path) -> dict[str, Any]:
    started: list[processes.Process] = []
    try:
        fast_stub, fast = processes.start_stub(
            workdir, "--reasoning-tokens", "0", "--content-tokens", "8"
        )
        big_stub, big = processes.start_stub(
            workdir, "--reasoning-tokens", "0", "--content-tokens", "40000"
        )
        started += [fast_stub, big_stub]
        gateways = []
        for i, twistd in enumerate(twistds):
            processes.TWISTD = twistd
            home = workdir / f"gateway-{i}"
            home.mkdir()
            gateway, url = processes.start_gateway(home, config(fast, big, fast))
            started.append(gateway)
            gateways.append((url, ProcessStats(gateway.popen.pid)))
        results: list[list[dict[str, Any]]] = [[] for _ in twistds]
        for r in range(rounds):
            order = range(len(gateways)) if r % 2 == 0 else reversed(range(len(gateways)))
            for k in order:
                results[k].append(one_round(*gateways[k], fast, big))
                print("AB"[k], r, json.dumps(results[k][-1]), flush=True)
        return {
            twistd: {
                "rounds": rows,
                "median": {f: statistics.median(row[f] for row in rows) for f in FIGURES},
            }
            for twistd, rows in zip(twistds, results, strict=True)
        }
    finally:
        for process in started:
            process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("twistd_a")
    parser.add_argument("twistd_b")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        report = run([args.twistd_a, args.twistd_b], args.rounds, Path(workdir))
    for twistd, figures in report.items():
        print(twistd, json.dumps(figures["median"]))


if __name__ == "__main__":
    main()
