"""Slots and the queue over real sockets: queue frames, positions, leaving, limits, timeouts."""

from __future__ import annotations

import gc
import inspect
import json
import sys
import time
import tracemalloc
import types
from typing import Any

from tests.surfaces.test_llm import LLMSurface
from tests.surfaces.test_proxy import async_test
from testsupport import helpers
from testsupport.grammar import check_stream
from testsupport.helpers import PROMPTLY, chat, raw_request, wait_for


class Queue(LLMSurface):
    stub_settings = {"hold": 0.6, "delay": 0.01, "reasoning_tokens": 2, "content_tokens": 2}

    def fill(self, n: int, **kw: Any) -> list[Any]:
        return [raw_request(self.port, "POST", "/llm/v1/messages", chat(**kw)) for _ in range(n)]

    async def drain(self, responses: list[Any]) -> None:
        for response in responses:
            await response.closed

    @async_test
    async def test_a_queued_stream_is_told_its_position_then_gets_the_standard_sequence(
        self,
    ) -> None:
        busy = self.fill(4)
        await wait_for(lambda: len(self.slots.waiting) == 2, what="two to queue")
        sent = time.monotonic()
        fifth = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await fifth.until_text("event: queue")
        self.assertLess(time.monotonic() - sent, PROMPTLY)
        self.assertEqual(fifth.status, 200)
        self.assertEqual(fifth.header("content-type"), "text/event-stream; charset=utf-8")
        self.assertEqual(fifth.frames()[0], ("queue", {"type": "queue", "position": 3}))
        await fifth.closed
        frames = [d for _, d in fifth.frames()]
        self.assertEqual(check_stream(frames), "complete")
        positions = [f["position"] for f in frames if f["type"] == "queue"]
        self.assertEqual(positions, sorted(positions, reverse=True))
        self.assertEqual(positions[0], 3)
        self.assertEqual(positions[-1], 1)
        self.assertLessEqual(self.stub.stats.max_in_flight, 2)
        await self.drain(busy)
        await self.settled()

    @async_test
    async def test_a_waiting_request_holds_no_raw_body(self) -> None:
        """While it waits, a request keeps only its mapped form: the body it arrived with (a
        coding agent's is 100 KB or more) is let go once parsed."""
        busy = self.fill(2)
        await wait_for(lambda: self.slots.in_use == 2, what="slots to fill")
        queued = raw_request(self.port, "POST", "/llm/v1/messages", chat(content="x" * 5000))
        await queued.until_text("event: queue")
        in_flight = list(self.servers.gateway.inflight._active)
        self.assertTrue(in_flight)
        self.assertTrue(all(r.content.closed for r in in_flight))
        await queued.closed
        self.assertEqual(check_stream([d for _, d in queued.frames()]), "complete")
        await self.drain(busy)

    @async_test
    async def test_a_waiting_request_costs_at_most_twice_its_body(self) -> None:
        """A waiter keeps its upstream body as JSON bytes, not the parsed tree: one-character
        messages, the costliest body per byte, cost 6-8 times their size as a tree
        (`python -m bench.waiters --messages N` measures it at scale)."""
        first = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False))
        await first.closed  # a whole life, every module it imports, before the one measured
        busy = self.fill(2)
        await wait_for(lambda: self.slots.in_use == 2, what="slots to fill")
        history = [{"role": ("user", "assistant")[i % 2], "content": "a"} for i in range(20_000)]
        body = json.dumps(chat(messages=[*history, {"role": "user", "content": "hi"}])).encode()
        gc.collect()
        tracemalloc.start()
        self.addCleanup(tracemalloc.stop)
        queued = raw_request(self.port, "POST", "/llm/v1/messages", body)
        await queued.until_text("event: queue")
        gc.collect()
        held = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, helpers.__file__)]  # the client's copy of its request
        )
        tracemalloc.stop()
        size, kept = len(body), sum(stat.size for stat in held.statistics("filename"))
        self.assertLess(kept, 2 * size, f"{kept:,} B held for a {size:,} B body")
        await queued.closed
        self.assertEqual(check_stream([d for _, d in queued.frames()]), "complete")
        await self.drain(busy)

    @async_test
    async def test_a_finished_request_leaves_its_body_to_nobody(self) -> None:
        """A finished request's objects can wait in reference cycles until the collector runs
        (rarely, in the daemon: `collector.tune_collector`): none of them may hold its body."""
        first = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False))
        await first.closed  # a whole life, every module it imports, before the one measured
        gc.disable()
        self.addCleanup(gc.enable)
        tracemalloc.start()
        self.addCleanup(tracemalloc.stop)
        size = 1_000_000
        for i in range(3):
            user = {"user_id": f"{i}" * size}
            response = raw_request(
                self.port, "POST", "/llm/v1/messages", chat(stream=False, metadata=user)
            )
            await response.closed
            self.assertEqual(response.status, 200)
        del user
        await wait_for(lambda: not self.servers.gateway.inflight, what="the requests to end")
        held = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, helpers.__file__)]  # the client's copies
        )
        kept = sum(stat.size for stat in held.statistics("filename"))
        self.assertLess(kept, size, f"{kept:,} B held after three {size:,} B bodies")

    @async_test
    async def test_a_waiting_request_keeps_a_digest_of_its_session(self) -> None:
        """The session (Claude Code's header, or `metadata.user_id`) is the client's string of
        any size: the line keeps a fixed-size digest of it, in the waiter and in the session
        table."""
        busy = self.fill(2)
        await wait_for(lambda: self.slots.in_use == 2, what="slots to fill")
        user = chat(metadata={"user_id": "u" * 1_000_000})
        header = {"x-claude-code-session-id": "s" * 8000}
        queued = [
            raw_request(self.port, "POST", "/llm/v1/messages", user),
            raw_request(self.port, "POST", "/llm/v1/messages", chat(), headers=header),
        ]
        for response in queued:
            await response.until_text("event: queue")
        kept = [len(want.session) for want in self.slots.dispatch._wants.values()]
        self.assertEqual(kept, [32, 32])
        await self.drain(queued)
        self.assertEqual([len(key) for key in self.slots.sessions._last], [32, 32])
        self.assertEqual(len(self.slots.sessions), 2)
        await self.drain(busy)

    @async_test
    async def test_a_waiting_request_and_its_connection_keep_compact_attribute_dicts(
        self,
    ) -> None:
        """A waiter's `Request` and channel keep their attributes in their class's shared key
        table (a few hundred bytes), not a dict of their own (1.6 KB each): that happens when
        their classes' instances set more than 30 names over their lives, which the slots of
        `GatewayRequest` and `GatewayChannel` prevent (see `channel`)."""
        finished = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await finished.closed  # a whole life, every name it sets, before the one measured
        busy = self.fill(2)
        await wait_for(lambda: self.slots.in_use == 2, what="slots to fill")
        queued = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await queued.until_text("event: queue")
        waiting = [r for r in self.servers.gateway.inflight._active if not r.finished]
        for request in waiting:
            self.assertLess(sys.getsizeof(vars(request)), 1000)
            self.assertLess(sys.getsizeof(vars(request.channel)), 1000)
        await queued.closed
        await self.drain(busy)

    @async_test
    async def test_a_waiting_request_keeps_no_callbacks_of_kleins_render_chain(self) -> None:
        """Klein routes a waiter, but its flight answers it (`web.AnsweredByItsFlight`), so
        Klein's render chain ended when the route returned: the request keeps two
        `notifyFinish` Deferreds Klein adds before it calls a route (its `_finish` closure and
        the lambda that would cancel the route's Deferred, already fired), and none of the
        closures and callback pairs that wait to write an answer (~2.4 KB a waiter, `python -m
        bench.waiters`) nor Klein's URL map adapter (a `KleinRequest`, ~0.7 KB)."""
        busy = self.fill(2)
        await wait_for(lambda: self.slots.in_use == 2, what="slots to fill")
        queued = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await queued.until_text("event: queue")
        flights = self.servers.gateway.inflight._active
        waiting = [r for r, f in flights.items() if f.record.queue_wait is None]
        self.assertEqual(len(waiting), 1)  # the two holding a slot have waited
        for request in waiting:
            self.assertEqual(len(request.notifications), 3)  # Klein's two, InFlight's
            self.assertEqual(request._adapterCache, {})  # no KleinRequest with a map adapter
        gc.collect()
        kleins = [
            f.__qualname__.rpartition(".")[2]
            for f in gc.get_objects()
            if isinstance(f, types.FunctionType)
            and f.__qualname__.startswith("KleinResource.render.<locals>.")
        ]
        self.assertEqual(sorted(kleins), sorted(["<lambda>", "_finish"] * len(flights)))
        await queued.closed
        self.assertEqual(check_stream([d for _, d in queued.frames()]), "complete")
        await self.drain(busy)

    @async_test
    async def test_a_waiting_stream_lets_its_sent_response_headers_go(self) -> None:
        """Once the first queue frame is written the head is on the wire; the request keeps no
        copy of its headers for its wait (~1.2 KB a waiter, `python -m bench.waiters`)."""
        busy = self.fill(2)
        await wait_for(lambda: self.slots.in_use == 2, what="slots to fill")
        queued = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await queued.until_text("event: queue")
        self.assertEqual(queued.header("content-type"), "text/event-stream; charset=utf-8")
        self.assertEqual(queued.header("cache-control"), "no-cache")
        self.assertTrue(queued.header("request-id"))
        written = [r for r in self.servers.gateway.inflight._active if r.startedWriting]
        self.assertTrue(written)
        for request in written:
            self.assertEqual(list(request.responseHeaders.getAllRawHeaders()), [])
        await queued.closed
        self.assertEqual(check_stream([d for _, d in queued.frames()]), "complete")
        await self.drain(busy)

    @async_test
    async def test_a_waiting_stream_awaits_through_three_coroutines(self) -> None:
        """`answer` -> `attempts` -> `hold_slot` -> the line's Deferred: each coroutine's
        frame is held for the whole wait, so a stream has no coroutine level of its own (its
        frame was ~0.3 KB a waiter, `python -m bench.waiters`)."""
        busy = self.fill(2)
        await wait_for(lambda: self.slots.in_use == 2, what="slots to fill")
        queued = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await queued.until_text("event: queue")
        flights = self.servers.gateway.inflight._active
        (waiting,) = [r for r, f in flights.items() if f.record.queue_wait is None]
        (outer,) = [
            o
            for o in gc.get_objects()
            if inspect.iscoroutine(o)
            and o.cr_code.co_name == "answer"
            and o.cr_frame is not None  # a finished one, not yet collected, has no frame
            and o.cr_frame.f_locals.get("request") is waiting
        ]
        chain, awaited = [], outer
        while inspect.iscoroutine(awaited):
            chain.append(awaited.cr_code.co_name)
            awaited = awaited.cr_await
        self.assertEqual(chain, ["answer", "attempts", "hold_slot"])
        await queued.closed
        self.assertEqual(check_stream([d for _, d in queued.frames()]), "complete")
        await self.drain(busy)

    @async_test
    async def test_a_waiting_request_lets_its_read_request_headers_go(self) -> None:
        """What the gateway needs from a request's headers (the key, the client, the class,
        the session) is read before it waits; it keeps none of them for its wait (~0.7 KB a
        waiter with bench's five headers, `python -m bench.waiters`; a real client sends
        more)."""
        busy = self.fill(2)
        await wait_for(lambda: self.slots.in_use == 2, what="slots to fill")
        session = {"x-claude-code-session-id": "s-1", "x-priority": "batch"}
        queued = raw_request(self.port, "POST", "/llm/v1/messages", chat(), headers=session)
        await queued.until_text("event: queue")
        flights = self.servers.gateway.inflight._active
        (waiting,) = [r for r, f in flights.items() if f.record.queue_wait is None]
        self.assertEqual(list(waiting.requestHeaders.getAllRawHeaders()), [])
        self.assertEqual(flights[waiting].record.priority, "batch")
        await queued.closed
        self.assertEqual(check_stream([d for _, d in queued.frames()]), "complete")
        await self.drain(busy)

    @async_test
    async def test_dropping_queue_frames_leaves_a_valid_anthropic_stream(self) -> None:
        busy = self.fill(2)
        await wait_for(lambda: self.slots.in_use == 2, what="slots to fill")
        queued = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await queued.closed
        frames = [d for _, d in queued.frames() if d["type"] != "queue"]
        self.assertEqual(check_stream(frames, allow_queue=False), "complete")
        await self.drain(busy)

    @async_test
    async def test_a_queued_client_that_leaves_never_reaches_the_upstream(self) -> None:
        busy = self.fill(2)
        await wait_for(lambda: self.slots.in_use == 2, what="slots to fill")
        leaver = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        stayer = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await stayer.until_text('"position":2')
        leaver.disconnect()
        await wait_for(lambda: len(self.slots.waiting) == 1, what="the leaver to leave the line")
        await stayer.until_text('"position":1')
        await self.drain([*busy, stayer])
        self.assertEqual(self.stub.stats.requests, 3, "the leaver reached the upstream")
        await self.settled()

    @async_test
    async def test_non_streaming_waits_silently_then_answers(self) -> None:
        busy = self.fill(2)
        await wait_for(lambda: self.slots.in_use == 2, what="slots to fill")
        response = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False))
        await response.closed
        self.assertEqual(response.status, 200)
        self.assertEqual(json.loads(response.body_text())["type"], "message")
        await self.drain(busy)

    @async_test
    async def test_queue_limit_rejects_at_once_without_touching_the_upstream(self) -> None:
        self.slots.queue_limit = 1
        busy = self.fill(3)
        await wait_for(lambda: len(self.slots.waiting) == 1, what="the line to fill")
        started = time.monotonic()
        message = await self.error(chat(), 529, "overloaded_error")
        self.assertLess(time.monotonic() - started, PROMPTLY)
        self.assertIn("queue is full", message)
        await self.drain(busy)
        self.assertEqual(self.stub.stats.requests, 3)
        await self.settled()

    @async_test
    async def test_queue_full_carries_retry_after(self) -> None:
        self.slots.queue_limit = 0
        busy = self.fill(2)
        await wait_for(lambda: self.slots.in_use == 2, what="slots to fill")
        response = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await response.closed
        self.assertEqual(response.status, 529)
        self.assertGreater(int(response.header("retry-after")), 0)
        await self.drain(busy)

    @async_test
    async def test_queue_timeout_after_queue_frames_is_an_error_frame(self) -> None:
        self.servers.gateway.pools["vllm"].queue_timeout = 0.3
        busy = self.fill(2)
        await wait_for(lambda: self.slots.in_use == 2, what="slots to fill")
        streamed = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        whole = raw_request(self.port, "POST", "/llm/v1/messages", chat(stream=False))
        await streamed.closed
        await whole.closed
        frames = [d for _, d in streamed.frames()]
        self.assertEqual([f["type"] for f in frames], ["queue", "error"])
        self.assertEqual(frames[-1]["error"]["type"], "overloaded_error")
        self.assertEqual(whole.status, 529)
        await self.drain(busy)
        self.assertEqual(self.stub.stats.requests, 2)
        await self.settled()

    @async_test
    async def test_an_upstream_refusal_after_queue_frames_is_an_error_frame(self) -> None:
        busy = self.fill(2)
        await wait_for(lambda: self.slots.in_use == 2, what="slots to fill")
        refused = raw_request(self.port, "POST", "/llm/v1/messages", chat(content="error500"))
        await refused.closed
        self.assertEqual(refused.status, 200)
        self.assertEqual([name for name, _ in refused.frames()][-1], "error")
        self.assertEqual(check_stream([d for _, d in refused.frames()]), "error")
        await self.drain(busy)

    @async_test
    async def test_queue_frames_carry_a_wait_estimate_once_there_is_history(self) -> None:
        busy = self.fill(3)
        await wait_for(lambda: len(self.slots.waiting) == 1, what="one to queue")
        await self.drain(busy)
        self.assertNotIn(b"estimated_wait_s", busy[2].body_bytes(), "no history yet")
        await self.drain(self.fill(2))
        busy = self.fill(2)
        await wait_for(lambda: self.slots.in_use == 2, what="slots to fill")
        queued = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await queued.until_text("event: queue")
        first = queued.frames()[0][1]
        self.assertEqual(first["position"], 1)
        self.assertGreater(first["estimated_wait_s"], 0)
        self.assertLess(first["estimated_wait_s"], 5 * self.stub_settings["hold"] + 5)
        await self.drain([*busy, queued])
        self.assertEqual(check_stream([d for _, d in queued.frames()]), "complete")
        await self.settled()

    @async_test
    async def test_status_shows_slots_and_waiters(self) -> None:
        busy = self.fill(3)
        await wait_for(lambda: len(self.slots.waiting) == 1, what="one to queue")
        response = raw_request(self.port, "GET", "/llm/v1/status")
        await response.closed
        vllm = json.loads(response.body_text())["upstreams"]["vllm"]
        self.assertEqual(
            {k: vllm[k] for k in ("slots", "in_use", "waiting", "health")},
            {"slots": 2, "in_use": 2, "waiting": 1, "health": "up"},
        )
        self.assertEqual(vllm["waiting_by_class"], {"interactive": 0, "normal": 1, "batch": 0})
        self.assertEqual(vllm["waiting_by_client"], {"127.0.0.1": 1})
        await self.drain(busy)
        await self.settled()


class QueueKeepAlive(LLMSurface):
    stub_settings = {"hold": 0.8, "reasoning_tokens": 0, "content_tokens": 1}
    gateway_overrides = {"slots": 1, "server": {"ping_interval": 0.2}}

    @async_test
    async def test_an_unchanged_position_is_repeated_every_ping_interval(self) -> None:
        busy = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await wait_for(lambda: self.slots.in_use == 1, what="the slot to fill")
        queued = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await queued.closed
        positions = [d["position"] for name, d in queued.frames() if name == "queue"]
        self.assertGreaterEqual(len(positions), 3)
        self.assertEqual(set(positions), {1})
        self.assertEqual(check_stream([d for _, d in queued.frames()]), "complete")
        await busy.closed
