"""Benchmarks: what the gateway costs, measured beside the upstream in the same run.

`make bench` (or `python -m bench`) starts the stub upstreams (fast: no hold, no delay) and the
gateway on loopback as real twistd processes, runs each scenario against the gateway and, where
there is one, directly against the stub, interleaved over several rounds, and prints a table and
writes JSON (bench/results/). These are measurements, not tests: nothing here fails on a figure.

  1 throughput     8 concurrent 10,000-token streams: tokens/s through /llm vs direct, paired
  2 latency        200 sequential short requests: time to first token, gateway - direct
  (the gateway's own CPU per 1,000 tokens or per request is printed beside each figure)
  3 queue          5,000 streams behind slots = 2: FIFO, RSS and CPU per request, frames, staleness
  4 cancellation   100 streams cut at random: client close -> stub logs `cancelled`
  5 slow reader    1 KB/s from a 10 MB stream: the gateway's RSS over time
  6 burst          5,000 clients connecting at once behind 2 slots, fresh gateway (bench.burst)
  7 fair share     two equal-weight clients flood slots = 2 (one's requests 4x longer) while an
                   interactive client asks every 0.5 s: slot-time shares and Jain's index, the
                   interactive client's wait p50/p95, with named clients and then as one FIFO
  8 replicas       16 streams for one model over one paced stub replica (4 slots), then over two
                   (4 slots each, one line): tokens/s and requests/s, and how the work split
  9 surfaces       scenario 1 through /llm/v1/chat/completions, /llm/v1/messages and
                   /llm/v1/responses beside the direct stub, round by round: ratios and CPU per
                   1,000 tokens (bench.surfaces)

`--target URL --model NAME` runs scenarios 1 and 2 against any Anthropic-compatible endpoint
instead (e.g. another gateway), with nothing started here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from bench import burst, surfaces
from bench.scenarios import (
    RESULTS,
    ProcessStats,
    cancellation,
    config,
    latency,
    machine,
    profile_pass,
    queue_scale,
    run_fair_share,
    run_replicas,
    slow_reader,
    table,
    throughput,
)
from testsupport.processes import Process, start_gateway, start_stub


def run_local(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    paced_log = workdir / "paced.log"
    processes: list[Process] = []
    try:
        fast_stub, fast = start_stub(workdir, "--reasoning-tokens", "0", "--content-tokens", "8")
        big_stub, big = start_stub(workdir, "--reasoning-tokens", "0", "--content-tokens", "40000")
        paced_stub, paced = start_stub(
            workdir, "--reasoning-tokens", "0", "--delay", "0.01", "--log", str(paced_log)
        )
        processes += [fast_stub, big_stub, paced_stub]
        gateway_config = config(fast, big, paced)
        gateway, url = start_gateway(workdir, gateway_config)
        processes.append(gateway)
        stats = ProcessStats(gateway.popen.pid)
        report: dict[str, Any] = {"machine": machine()}
        print("1 throughput ...", file=sys.stderr)
        report["1_throughput"] = asyncio.run(
            throughput(big, url + "/llm", "bulk", args.rounds, stats)
        )
        print("2 latency ...", file=sys.stderr)
        report["2_latency"] = asyncio.run(
            latency(fast, url + "/llm", "fast", args.latency_requests, stats)
        )
        print("3 queue scale ...", file=sys.stderr)
        report["3_queue"] = asyncio.run(queue_scale(url, stats, args.waiters))
        print("4 cancellation ...", file=sys.stderr)
        report["4_cancellation"] = asyncio.run(cancellation(url, paced_log, 100, args.seed))
        print("5 slow reader ...", file=sys.stderr)
        report["5_slow_reader"] = asyncio.run(slow_reader(url, big, stats, args.slow_seconds))
        gateway.stop()
        processes.remove(gateway)
        print("6 burst ...", file=sys.stderr)
        report["6_burst"] = burst.run(workdir, args.burst_clients)
        report["7_fair_share"] = run_fair_share(workdir, processes, args.fair_seconds)
        report["8_replicas"] = run_replicas(workdir, processes, args.replica_streams, args.rounds)
        print("9 surfaces ...", file=sys.stderr)
        report["9_surfaces"] = surfaces.run(workdir, args.rounds)
        if args.profile:
            print("profile ...", file=sys.stderr)
            report["profile"] = profile_pass(workdir, gateway_config, big)
        return report
    finally:
        for process in processes:
            process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--latency-requests", type=int, default=200)
    parser.add_argument("--waiters", type=int, default=5000)
    parser.add_argument("--slow-seconds", type=float, default=15.0)
    parser.add_argument("--burst-clients", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fair-seconds", type=float, default=60.0, help="per phase, scenario 7")
    parser.add_argument(
        "--only-fair", action="store_true", help="run scenario 7 alone (it starts its own gateway)"
    )
    parser.add_argument(
        "--only-replicas",
        action="store_true",
        help="run scenario 8 alone (it starts its own stubs and gateway)",
    )
    parser.add_argument(
        "--replica-streams", type=int, default=16, help="concurrent streams, scenario 8"
    )
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument(
        "--target", help="an Anthropic-compatible base URL ending in the part before /v1"
    )
    parser.add_argument("--model", default="fast", help="the model to ask for with --target")
    args = parser.parse_args()
    if args.target:
        report = {
            "target": args.target,
            "1_throughput": asyncio.run(throughput(None, args.target, args.model, args.rounds)),
            "2_latency": asyncio.run(latency(None, args.target, args.model, args.latency_requests)),
        }
    elif args.only_fair or args.only_replicas:
        with tempfile.TemporaryDirectory() as workdir:
            processes: list[Process] = []
            try:
                report = {"machine": machine()}
                if args.only_fair:
                    report["7_fair_share"] = run_fair_share(
                        Path(workdir), processes, args.fair_seconds
                    )
                if args.only_replicas:
                    report["8_replicas"] = run_replicas(
                        Path(workdir), processes, args.replica_streams, args.rounds
                    )
            finally:
                for process in processes:
                    process.stop()
    else:
        with tempfile.TemporaryDirectory() as workdir:
            report = run_local(args, Path(workdir))
    profile = report.pop("profile", None)
    print(table(report))
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"bench-{stamp}.json").write_text(json.dumps(report, indent=2))
    if profile:
        (RESULTS / f"profile-{stamp}.txt").write_text(profile)
        print(f"\nprofile: bench/results/profile-{stamp}.txt")
    print(f"results: bench/results/bench-{stamp}.json")


if __name__ == "__main__":
    main()
