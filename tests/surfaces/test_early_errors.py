"""What a request answered with an early error (invalid JSON, a wrong-typed field, an unknown
model) leaves behind: nothing of its body, with no garbage collection to give it back."""

from __future__ import annotations

import gc
import json
import tracemalloc
from typing import Any

from tests.surfaces.test_llm import LLMSurface
from tests.surfaces.test_proxy import async_test
from testsupport.helpers import chat, raw_request

BIG = "x" * 1_000_000
MIB = 1024 * 1024


def bad_requests() -> list[tuple[str, bytes, int]]:
    """A ~1 MB request refused early, on each surface that answers from the line: (path,
    body, status)."""
    user = [{"role": "user", "content": BIG}]
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/llm/v1/messages", chat(content=BIG), "max_tokens"),
        ("/llm/v1/chat/completions", {"model": "reasoning", "messages": user}, "max_tokens"),
        ("/llm/v1/responses", {"model": "reasoning", "input": BIG}, "max_output_tokens"),
    ]
    requests = []
    for path, body, limit in cases:
        whole = json.dumps(body).encode()
        requests.append((path, whole[:-1], 400))  # not JSON: cut short
        requests.append((path, json.dumps({**body, limit: "many"}).encode(), 400))
        requests.append((path, json.dumps({**body, "model": BIG}).encode(), 404))
    return requests


def gateway_memory() -> int:
    """Bytes traced now, less what the test's client allocated (it keeps what it sent, in a
    cycle of its own)."""
    client = tracemalloc.Filter(False, "*/testsupport/helpers.py", all_frames=True)
    snapshot = tracemalloc.take_snapshot().filter_traces([client])
    return sum(stat.size for stat in snapshot.statistics("filename"))


class EarlyErrors(LLMSurface):
    async def send(self, path: str, body: bytes, status: int) -> str:
        response = raw_request(self.port, "POST", path, body)
        await response.closed
        self.assertEqual(response.status, status, response.body_text()[:300])
        return response.body_text()

    @async_test
    async def test_sixty_early_errors_of_a_megabyte_keep_nothing_without_a_collection(
        self,
    ) -> None:
        requests = bad_requests()
        for path, body, status in requests:  # once each first: what stays is not their bodies
            await self.send(path, body, status)
        gc.collect()
        gc.disable()  # an idle gateway rarely runs a full collection
        self.addCleanup(gc.enable)
        tracemalloc.start(8)  # deep enough to tell the test client's allocations
        self.addCleanup(tracemalloc.stop)
        before = gateway_memory()
        for i in range(60):
            await self.send(*requests[i % len(requests)])
        kept = gateway_memory() - before
        self.assertLess(kept, 10 * MIB, f"{kept / MIB:.1f} MiB kept by 60 refused requests")

    @async_test
    async def test_an_unknown_models_404_echoes_a_bounded_prefix_of_its_name(self) -> None:
        for path, body, status in bad_requests():
            if status == 404:
                self.assertLess(len(await self.send(path, body, status)), 2000, path)
