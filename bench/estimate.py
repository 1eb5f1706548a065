"""How good is `estimated_wait_s`? Each waiter's first estimate against its real wait.

`python -m bench.estimate [--seconds 60] [--clients 8] [--seed 1]` starts a stub and a gateway
(slots = 2) as twistd processes and keeps `--clients` streaming clients busy, each sending a
stream as soon as its last one ended, with answers of random length (20 to 100 tokens at 20 ms
a token: 0.4 to 2 s of slot time). For every request that waited, it compares the estimate in
its first `event: queue` frame with the time from that frame to its `message_start`, and prints
the median and 90th percentile of the relative error |estimate - wait| / wait, and the median
signed error (positive: the estimate was too long). Waits under 50 ms are left out: their
relative error says nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from testsupport.client import percentile, request
from testsupport.processes import Process, start_gateway, start_stub

SHORTEST_WAIT = 0.05


def config(stub: str) -> str:
    return f"""
[upstreams.paced]
url = "{stub}"
slots = 2
queue_limit = 1000

[models.paced]
upstream = "paced"
"""


async def load(gateway: str, seconds: float, clients: int, seed: int) -> dict[str, Any]:
    url = gateway + "/llm/v1/messages"
    rng = random.Random(seed)
    stop = time.monotonic() + seconds
    pairs: list[tuple[float, float]] = []
    without = 0

    async def client() -> None:
        nonlocal without
        while time.monotonic() < stop:
            body = {
                "model": "paced",
                "max_tokens": rng.randint(20, 100),
                "stream": True,
                "messages": [{"role": "user", "content": "content-only"}],
            }
            result = await request(url, body)
            queued = result.first(lambda f: f.event == "queue")
            started = result.first(lambda f: f.event == "message_start")
            if queued is None or started is None:
                continue
            estimate = queued.data.get("estimated_wait_s")
            if estimate is None:
                without += 1
                continue
            waited = started.at - queued.at
            if waited >= SHORTEST_WAIT:
                pairs.append((estimate, waited))

    await asyncio.gather(*(client() for _ in range(clients)))
    relative = [abs(e - w) / w for e, w in pairs]
    signed = [(e - w) / w for e, w in pairs]
    return {
        "seconds": seconds,
        "clients": clients,
        "slots": 2,
        "waiters_compared": len(pairs),
        "waiters_without_estimate": without,
        "median_wait_s": round(statistics.median(w for _, w in pairs), 3) if pairs else None,
        "relative_error_p50": round(percentile(relative, 50), 3),
        "relative_error_p90": round(percentile(relative, 90), 3),
        "signed_error_p50": round(percentile(signed, 50), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    processes: list[Process] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        try:
            stub, url = start_stub(
                workdir,
                *("--reasoning-tokens", "0", "--content-tokens", "1000"),
                *("--delay", "0.02"),
            )
            processes.append(stub)
            gateway, gateway_url = start_gateway(workdir, config(url))
            processes.append(gateway)
            report = asyncio.run(load(gateway_url, args.seconds, args.clients, args.seed))
        finally:
            for process in processes:
                process.stop()
    print(json.dumps(report, indent=2))
    print(
        f"estimate vs real wait: median error {report['relative_error_p50']:.0%}, "
        f"p90 {report['relative_error_p90']:.0%} over {report['waiters_compared']} waiters",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
