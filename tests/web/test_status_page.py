"""The status page: its event stream's timing on a Clock, and the page and stream on real sockets.

The browser's view of it is tests/web/test_status_browser.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from homelab_gateway.line.limiter import PositionedSemaphore
from homelab_gateway.telemetry import Telemetry
from homelab_gateway.web.statuspage import (
    FULL_RETRY_AFTER,
    HEARTBEAT,
    LIVE_INTERVAL,
    MAX_SUBSCRIBERS,
    MIN_INTERVAL,
    STALL_TIMEOUT,
    USAGE_INTERVAL,
    StatusPage,
)
from tests.surfaces.test_proxy import async_test
from testsupport.helpers import (
    PROMPTLY,
    RawResponse,
    Servers,
    SoonerResetClock,
    chat,
    gateway_document,
    raw_request,
    send_raw,
    wait_for,
)

KEY = "sk-gw-status-page-key"


class FakeTransport:
    aborted = False

    def abortConnection(self) -> None:
        self.aborted = True


class FakeRequest:
    """What StatusPage.subscribe uses of a request: headers, a status, a producer, writes, and
    the channel's transport (to cut a stalled reader)."""

    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self.code = 200
        self.producer: Any = None
        self.written: list[bytes] = []
        self.channel = SimpleNamespace(transport=FakeTransport())

    def setHeader(self, name: bytes, value: bytes) -> None:
        self.headers[name] = value

    def setResponseCode(self, code: int) -> None:
        self.code = code

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.producer = producer

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def events(self) -> list[tuple[str, dict[str, Any]]]:
        """Every frame as (event, data)."""
        out = []
        for frame in self.written:
            head, data = frame.decode().rstrip("\n").split("\n")
            out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
        return out

    def snapshots(self) -> list[dict[str, Any]]:
        out = []
        for frame in self.written:
            head, data = frame.decode().rstrip("\n").split("\n")
            assert head == "event: snapshot", frame
            out.append(json.loads(data.removeprefix("data: ")))
        return out


class Pushing(TestCase):
    def setUp(self) -> None:
        self.clock = SoonerResetClock()
        self.clock.advance(1000)
        self.slots = PositionedSemaphore(1, self.clock)
        self.document: dict[str, Any] = {"upstreams": {"vllm": {"slots": 1, "waiting": 0}}}
        self.telemetry = Telemetry(self.clock, {})
        self.page = StatusPage(
            self.clock,
            self.telemetry,
            {"vllm": SimpleNamespace(line=self.slots)},  # type: ignore[dict-item]
            lambda: self.document,
        )

    def request(self) -> Any:
        return self.telemetry.start("req_x", "messages", b"POST", b"/llm/v1/messages")

    def test_nothing_runs_while_nobody_watches(self) -> None:
        for _ in range(100):
            self.telemetry.finish(self.request())
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_finished_are_the_requests_for_a_model_or_through_the_slots(self) -> None:
        for surface, fields in (
            ("messages", {"served_model": "reasoning"}),
            ("proxy", {"upstream": "vllm", "queue_wait": 0.0}),
            ("proxy", {"upstream": "/nas/"}),  # a plain route: no slots
            ("messages", {}),  # refused before its body was read: a 401
        ):
            record = self.telemetry.start("req_x", surface, b"POST", b"/x")
            for name, value in fields.items():
                setattr(record, name, value)
            self.telemetry.finish(record)
        self.assertEqual(
            [(r.surface, r.upstream) for r, _ in self.telemetry.recent],
            [("messages", ""), ("proxy", "vllm")],
        )
        self.assertEqual(self.telemetry.active, {})

    def test_a_snapshot_at_once_then_a_heartbeat_while_idle(self) -> None:
        request = FakeRequest()
        self.page.subscribe(request)  # type: ignore[arg-type]
        self.assertEqual(request.headers[b"content-type"], b"text/event-stream; charset=utf-8")
        self.assertEqual(len(request.written), 1)
        self.assertEqual(request.snapshots()[0]["upstreams"]["vllm"]["slots"], 1)
        self.clock.advance(HEARTBEAT - 0.01)
        self.assertEqual(len(request.written), 1)
        self.clock.advance(0.01)
        self.assertEqual(len(request.written), 2)

    def test_a_burst_of_changes_is_one_frame_within_the_interval(self) -> None:
        request = FakeRequest()
        self.page.subscribe(request)  # type: ignore[arg-type]
        self.clock.advance(5)
        for _ in range(1000):
            self.telemetry.finish(self.request())
        self.clock.advance(0)
        self.assertEqual(len(request.written), 2)  # the first change after a quiet spell: now
        for _ in range(1000):
            self.telemetry.finish(self.request())
        self.clock.advance(MIN_INTERVAL - 0.01)
        self.assertEqual(len(request.written), 2)
        self.clock.advance(0.01)
        self.assertEqual(len(request.written), 3)
        self.assertEqual(self.clock.moved_sooner, 0, "the heartbeat's timer was moved sooner")

    def test_frames_every_live_interval_while_someone_waits_then_idle_again(self) -> None:
        request = FakeRequest()
        self.page.subscribe(request)  # type: ignore[arg-type]
        self.document["upstreams"]["vllm"]["waiting"] = 1
        self.slots.acquire()
        waiter = self.slots.acquire().addErrback(lambda f: f.trap(CancelledError))
        self.page.changed()
        self.clock.advance(0)
        self.assertEqual(len(request.written), 2)
        for _ in range(3):
            self.clock.advance(LIVE_INTERVAL)
        self.assertEqual(len(request.written), 5)
        self.assertEqual(request.snapshots()[-1]["upstreams"]["vllm"]["longest_wait_s"], 3.0)
        waiter.cancel()
        self.document["upstreams"]["vllm"]["waiting"] = 0
        for _ in range(5):
            self.clock.advance(LIVE_INTERVAL)
        self.assertEqual(len(request.written), 6)  # idle: the next is a heartbeat
        self.assertIsNone(request.snapshots()[-1]["upstreams"]["vllm"]["longest_wait_s"])
        self.slots.close()

    def test_the_last_subscriber_leaving_stops_the_timer(self) -> None:
        first, second = FakeRequest(), FakeRequest()
        one = self.page.subscribe(first)  # type: ignore[arg-type]
        two = self.page.subscribe(second)  # type: ignore[arg-type]
        for subscription in (one, two):
            subscription.addErrback(lambda f: f.trap(CancelledError))
        one.cancel()
        self.assertNotEqual(self.clock.getDelayedCalls(), [])
        two.cancel()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.page.changed()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_reader_that_stopped_gets_only_the_newest_frame_when_it_reads_again(self) -> None:
        request = FakeRequest()
        self.page.subscribe(request)  # type: ignore[arg-type]
        request.producer.pauseProducing()
        self.clock.advance(HEARTBEAT * 3)
        self.assertEqual(len(request.written), 1)
        request.producer.resumeProducing()
        self.assertEqual(len(request.written), 2)
        self.assertEqual(request.snapshots()[-1]["uptime_s"], HEARTBEAT * 3)

    def subscribe(self) -> tuple[FakeRequest, Any]:
        request = FakeRequest()
        subscription = self.page.subscribe(request)  # type: ignore[arg-type]
        if isinstance(subscription, Deferred):
            subscription.addErrback(lambda f: f.trap(CancelledError))
        return request, subscription

    def test_a_stream_whose_first_frame_fails_is_not_kept(self) -> None:
        """Else it would count against max_status_subscribers for good."""

        def broken() -> Any:
            raise RuntimeError("a bug")

        self.patch(self.page, "snapshot", broken)
        with self.assertRaises(RuntimeError):
            self.page.subscribe(FakeRequest())  # type: ignore[arg-type]
        self.assertEqual(self.page.subscribers, set())

    def test_past_the_cap_one_more_is_refused_at_once_and_the_others_keep_streaming(
        self,
    ) -> None:
        self.assertEqual(MAX_SUBSCRIBERS, 64)
        streams = [self.subscribe() for _ in range(MAX_SUBSCRIBERS)]
        refused, answer = self.subscribe()
        self.assertEqual(refused.code, 503)
        self.assertEqual(refused.headers[b"retry-after"], str(FULL_RETRY_AFTER).encode())
        self.assertEqual(refused.headers[b"content-type"], b"application/json")
        error = json.loads(answer)["error"]
        self.assertEqual(error["type"], "overloaded_error")
        self.assertIn("max_status_subscribers = 64", error["message"])
        self.assertIsNone(refused.producer)
        self.assertEqual(refused.written, [])
        self.assertEqual(len(self.page.subscribers), MAX_SUBSCRIBERS)
        self.clock.advance(HEARTBEAT)
        self.assertEqual({len(request.written) for request, _ in streams}, {2})

    def test_one_that_leaves_frees_its_place(self) -> None:
        self.page.max_subscribers = 2
        (_, first), _ = self.subscribe(), self.subscribe()
        self.assertEqual(self.subscribe()[0].code, 503)
        first.cancel()  # Klein's cancel: the client left
        request, subscription = self.subscribe()
        self.assertIsInstance(subscription, Deferred)
        self.assertEqual(len(request.snapshots()), 1)
        self.assertEqual(self.subscribe()[0].code, 503)

    def test_a_lower_cap_keeps_those_open_and_refuses_the_next(self) -> None:
        streams = [self.subscribe() for _ in range(3)]
        self.page.max_subscribers = 1  # a reload
        self.assertEqual(self.subscribe()[0].code, 503)
        self.clock.advance(HEARTBEAT)
        self.assertEqual({len(request.written) for request, _ in streams}, {2})

    def test_zero_turns_the_stream_off(self) -> None:
        self.page.max_subscribers = 0
        request, answer = self.subscribe()
        self.assertEqual(request.code, 503)
        self.assertNotIn(b"retry-after", request.headers)
        self.assertIn("turned off", json.loads(answer)["error"]["message"])
        self.assertEqual((self.page.subscribers, self.clock.getDelayedCalls()), (set(), []))

    def test_a_reader_paused_for_the_stall_timeout_is_cut_and_forgotten(self) -> None:
        self.assertEqual(STALL_TIMEOUT, 120.0)
        stalled, subscription = self.subscribe()
        reading, _ = self.subscribe()
        stalled.producer.pauseProducing()
        self.clock.advance(STALL_TIMEOUT - 0.01)
        self.assertFalse(stalled.channel.transport.aborted)
        stalled.producer.pauseProducing()  # paused again while paused: the same timer
        self.clock.advance(0.01)
        self.assertTrue(stalled.channel.transport.aborted)
        self.assertEqual(self.page.subscribers, {reading.producer})
        # The abort lands later: twisted.web stops the producer, Klein cancels. Harmless.
        stalled.producer.stopProducing()
        subscription.cancel()
        self.assertEqual(self.page.subscribers, {reading.producer})
        self.assertFalse(reading.channel.transport.aborted)
        reading.producer.stopProducing()  # it goes too: no timer of the page's is left
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_reader_that_reads_again_in_time_is_kept(self) -> None:
        request, _ = self.subscribe()
        for _ in range(3):
            request.producer.pauseProducing()
            self.clock.advance(STALL_TIMEOUT - 1)
            request.producer.resumeProducing()
            self.clock.advance(1)
        self.assertFalse(request.channel.transport.aborted)
        self.assertEqual(self.page.subscribers, {request.producer})
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)  # the heartbeat only

    def test_a_client_leaving_while_paused_leaves_no_timer(self) -> None:
        request, subscription = self.subscribe()
        request.producer.pauseProducing()
        subscription.cancel()
        self.assertEqual((self.page.subscribers, self.clock.getDelayedCalls()), (set(), []))
        other, _ = self.subscribe()
        other.producer.pauseProducing()
        other.producer.stopProducing()  # the connection lost, before Klein hears of it
        self.assertEqual((self.page.subscribers, self.clock.getDelayedCalls()), (set(), []))
        self.clock.advance(STALL_TIMEOUT)
        self.assertFalse(other.channel.transport.aborted)

    def test_the_stall_timeout_a_stream_started_with_is_its_own(self) -> None:
        self.page.stall_timeout = 5
        request, _ = self.subscribe()
        self.page.stall_timeout = 500  # a reload: for streams opened after it
        request.producer.pauseProducing()
        self.clock.advance(5)
        self.assertTrue(request.channel.transport.aborted)


NOON = 1_796_212_800  # 2026-12-02T12:00:00Z


class Charts(TestCase):
    """The charts' samples and the per-day chart, on a Clock."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(NOON)
        self.slots = PositionedSemaphore(1, self.clock)
        self.addCleanup(self.slots.close)
        self.replica = SimpleNamespace(limit=2, held=0)
        self.telemetry = Telemetry(self.clock, {})
        self.reads: list[tuple[int, Deferred[list[tuple[str, int, int, int]]]]] = []
        self.page = StatusPage(
            self.clock,
            self.telemetry,
            {"vllm": SimpleNamespace(line=self.slots, replica=self.replica)},  # type: ignore[dict-item]
            lambda: {"upstreams": {}},
            tokens_by_hour=self.tokens_by_hour,
            sample_interval=10,
        )
        self.addCleanup(self.page.stop)

    async def tokens_by_hour(self, first: int) -> list[tuple[str, int, int, int]]:
        """The ledger: each read waits until the test answers it."""
        answer: Deferred[list[tuple[str, int, int, int]]] = Deferred()
        self.reads.append((first, answer))
        return await answer

    def subscribe(self) -> tuple[FakeRequest, Deferred[None]]:
        request = FakeRequest()
        subscription = self.page.subscribe(request)  # type: ignore[arg-type]
        assert isinstance(subscription, Deferred)
        subscription.addErrback(lambda f: f.trap(CancelledError))
        return request, subscription

    def generating(self, output_tokens: int) -> Any:
        record = self.telemetry.start("req_x", "messages", b"POST", b"/llm/v1/messages")
        record.queue_wait, record.input_tokens, record.output_tokens = 0.0, 100, output_tokens
        return record

    def test_samples_are_taken_while_nobody_watches_and_a_stream_starts_with_them(self) -> None:
        self.page.start()
        record = self.generating(0)
        self.replica.held = 1
        self.slots.acquire()
        waiter = self.slots.acquire().addErrback(lambda f: f.trap(CancelledError))
        self.clock.advance(10)
        record.output_tokens = 50
        self.clock.advance(10)
        request, _ = self.subscribe()
        (event, first), *_ = request.events()
        self.assertEqual(event, "snapshot")
        history = first["history"]
        self.assertEqual((history["interval"], history["size"]), (10, 360))
        self.assertEqual(history["fields"][:4], ["at", "slots", "in_use", "waiting"])
        self.assertEqual(
            history["samples"],
            [
                [NOON, 2, 0, 0, 0.0, 0.0],
                [NOON + 10, 2, 1, 1, 10.0, 0.0],
                [NOON + 20, 2, 1, 1, 0.0, 5.0],
            ],
        )
        waiter.cancel()
        self.telemetry.finish(record)
        self.clock.advance(10)
        samples = [data["sample"] for event, data in request.events() if event == "sample"]
        self.assertEqual(samples, [[NOON + 30, 2, 1, 0, 0.0, 0.0]])
        later = [data for event, data in request.events() if event == "snapshot"][1:]
        self.assertNotIn("history", later[0], "only the first frame carries the hour")

    def test_a_reader_that_missed_a_sample_gets_the_whole_hour_again(self) -> None:
        self.page.start()
        request, _ = self.subscribe()
        request.producer.pauseProducing()
        for _ in range(3):
            self.clock.advance(10)
        self.assertEqual(len(request.written), 1)
        request.producer.resumeProducing()
        (event, again) = request.events()[-1]
        self.assertEqual(event, "snapshot")
        self.assertEqual(len(again["history"]["samples"]), 4)
        self.assertNotIn("sample", [event for event, _ in request.events()])

    def test_a_reload_changes_the_interval_and_keeps_the_samples(self) -> None:
        self.page.start()
        self.page.set_sample_interval(30)
        self.clock.advance(29)
        self.assertEqual(len(self.page.history.samples), 1)
        self.clock.advance(1)
        self.assertEqual([s.at for s in self.page.history.samples], [NOON, NOON + 30])

    def test_usage_is_read_when_a_stream_opens_and_once_a_minute_while_one_is_open(self) -> None:
        first, leaving = self.subscribe()
        self.assertEqual([at for at, _ in self.reads], [NOON - 43200 - 13 * 86400])
        second, _ = self.subscribe()  # joins the read under way
        self.assertEqual(len(self.reads), 1)
        self.reads[0][1].callback([("frontend", NOON, 1000, 200), ("10.0.0.7", NOON, 5, 1)])
        for request in (first, second):
            (usage,) = [data for event, data in request.events() if event == "usage"]
            self.assertEqual(usage["days"][-1], "2026-12-02")
            self.assertEqual(
                [(row["client"], row["output_tokens"][-1]) for row in usage["clients"]],
                [("frontend", 200), ("10.0.0.7", 1)],
            )
        third, _ = self.subscribe()
        self.assertEqual(third.events()[1][0], "usage", "the last read, at once")
        self.assertEqual(len(self.reads), 2)
        self.reads[1][1].errback(RuntimeError("disk gone"))
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.clock.advance(USAGE_INTERVAL)
        self.assertEqual(len(self.reads), 3)
        self.reads[2][1].callback([])
        leaving.cancel()
        for request in (second, third):
            request.producer.stopProducing()
        self.assertEqual(self.clock.getDelayedCalls(), [])  # nobody watches: no read is due


class PageAndStream(TestCase):
    """The real gateway and stub on loopback sockets."""

    def start(self, **document: Any) -> None:
        self.servers = Servers(self)
        self.stub_url, self.stub, self.log = self.servers.stub(hold=0.3, delay=0.01)
        self.servers.start_gateway(
            {**gateway_document(self.stub_url, slots=1), **document},
            environ={"GATEWAY_KEYS": KEY},
        )
        self.port = self.servers.gateway_port

    async def get(self, path: str, **headers: str) -> RawResponse:
        response = raw_request(self.port, "GET", path, headers=headers)
        await response.closed
        return response

    def stream(self, **headers: str) -> RawResponse:
        response = raw_request(self.port, "GET", "/status/events", headers=headers)
        self.addCleanup(response.disconnect)
        return response

    @staticmethod
    def snapshots(response: RawResponse) -> list[dict[str, Any]]:
        return [data for event, data in response.frames() if event == "snapshot"]

    @async_test
    async def test_the_root_sends_a_browser_to_the_page(self) -> None:
        self.start()
        response = await self.get("/")
        self.assertEqual(response.status, 302)
        self.assertEqual(response.header("location"), "status")

    @async_test
    async def test_the_page_and_its_files_come_from_the_package_with_a_strict_policy(self) -> None:
        self.start()
        page = await self.get("/status")
        self.assertEqual(page.status, 200)
        self.assertEqual(page.header("content-type"), "text/html; charset=utf-8")
        policy = page.header("content-security-policy") or ""
        self.assertIn("default-src 'none'", policy)
        self.assertIn("script-src 'self'", policy)
        self.assertIn('src="status/status.js"', page.body_text())
        self.assertNotIn("http", page.body_text().replace('"http-equiv', ""))  # no CDN
        script = await self.get("/status/status.js")
        self.assertEqual(script.header("content-type"), "text/javascript; charset=utf-8")
        self.assertIn("status/events", script.body_text())
        style = await self.get("/status/status.css")
        self.assertEqual(style.header("content-type"), "text/css; charset=utf-8")
        self.assertEqual((await self.get("/status/status.html")).status, 404)
        options = raw_request(self.port, "OPTIONS", "/status/events")
        await options.closed
        self.assertEqual(options.status, 405)
        self.assertEqual((await self.get("/status/..%2fpool.py")).status, 404)

    @async_test
    async def test_the_stream_follows_a_request_through_the_slot(self) -> None:
        self.start()
        stream = self.stream(**{"accept-encoding": "gzip"})
        await stream.until_text("event: snapshot")
        self.assertEqual(stream.header("content-type"), "text/event-stream; charset=utf-8")
        self.assertIsNone(stream.header("content-encoding"))
        first = self.snapshots(stream)[0]
        self.assertEqual(first["upstreams"]["vllm"]["slots"], 1)
        self.assertEqual(first["upstreams"]["vllm"]["models"], ["reasoning"])
        self.assertTrue(first["version"])

        def seen(check: Any) -> bool:
            return any(check(s) for s in self.snapshots(stream))

        # 2,000 tokens, 10 ms apart: it holds the slot until it leaves.
        holder = raw_request(
            self.port, "POST", "/llm/v1/messages", chat(content="long", max_tokens=4000)
        )
        await wait_for(lambda: self.log.events("start"), what="the upstream request")
        queued = raw_request(self.port, "POST", "/llm/v1/messages", chat())
        await stream.until(
            lambda: seen(
                lambda s: (
                    s["upstreams"]["vllm"]["in_use"] == 1
                    and s["upstreams"]["vllm"]["waiting"] == 1
                    and s["in_flight_total"] == 1
                    and s["in_flight"][0]["output_tokens"] > 0
                )
            )
        )
        holder.disconnect()
        await queued.closed
        await stream.until(
            lambda: seen(
                lambda s: (
                    s["upstreams"]["vllm"]["in_use"] == 0
                    and not s["upstreams"]["vllm"]["waiting"]
                    and sorted(r["outcome"] for r in s["finished"])
                    == ["client_disconnected", "completed"]
                )
            )
        )
        finished = self.snapshots(stream)[-1]["finished"]
        done = next(r for r in finished if r["outcome"] == "completed")
        self.assertEqual(done["output_tokens"], 16)
        self.assertGreater(done["queue_wait_s"], 0)

    @async_test
    async def test_with_protect_metrics_the_data_needs_a_key_and_never_shows_one(self) -> None:
        self.start(auth={"api_keys_env": "GATEWAY_KEYS", "protect_metrics": True})
        self.assertEqual((await self.get("/status")).status, 200)  # the page holds no data
        refused = await self.get("/status/events")
        self.assertEqual(refused.status, 401)
        refused = await self.get("/status/events", **{"x-api-key": "wrong"})
        self.assertEqual(refused.status, 401)
        stream = self.stream(**{"x-api-key": KEY})
        await stream.until_text("event: snapshot")
        secret = "the secret prompt nobody may see"
        answer = raw_request(
            self.port, "POST", "/llm/v1/messages", chat(content=secret), {"x-api-key": KEY}
        )
        await answer.closed
        self.assertEqual(answer.status, 200)
        answer_text = "".join(
            data["delta"].get("text", "")
            for name, data in answer.frames()
            if name == "content_block_delta"
        )
        await stream.until(lambda: any(s["finished"] for s in self.snapshots(stream)))
        text = stream.body_text()
        for hidden in (KEY, secret, answer_text[:20]):
            self.assertNotIn(hidden, text)
        self.assertIn("key-", text)  # the client is named by its key's digest, not the key

    @async_test
    async def test_an_open_page_does_not_hold_up_shutdown(self) -> None:
        self.start()
        stream = self.stream()
        await stream.until_text("event: snapshot")
        gateway = self.servers.gateway
        assert gateway is not None
        self.assertEqual(len(gateway.app.status_page.subscribers), 1)
        # Well within close_timeout (5 s), which a connection kept open would wait out.
        await Deferred.fromCoroutine(gateway.drain()).addTimeout(PROMPTLY, reactor)
        await stream.closed
        self.assertEqual(gateway.app.status_page.subscribers, set())

    @async_test
    async def test_past_max_status_subscribers_one_more_gets_503_and_a_leaver_frees_a_place(
        self,
    ) -> None:
        self.start(server={"ping_interval": 10, "max_status_subscribers": 2})
        first, second = self.stream(), self.stream()
        for stream in (first, second):
            await stream.until_text("event: snapshot")
        refused = await self.get("/status/events")
        self.assertEqual(refused.status, 503)
        self.assertEqual(refused.header("retry-after"), "15")
        # A client that would keep its connection alive has it closed: its descriptor back.
        alive = send_raw(self.port, b"GET /status/events HTTP/1.1\r\nHost: gateway\r\n\r\n")
        await alive.closed.addTimeout(PROMPTLY, reactor)
        self.assertEqual((alive.status, alive.header("connection")), (503, "close"))
        error = json.loads(refused.body_text())["error"]
        self.assertEqual(error["type"], "overloaded_error")
        self.assertIn("max_status_subscribers = 2", error["message"])
        first.disconnect()
        page = self.servers.gateway.app.status_page  # type: ignore[union-attr]
        await wait_for(lambda: len(page.subscribers) == 1, what="the leaver to be forgotten")
        third = self.stream()
        await third.until_text("event: snapshot")
        self.assertEqual(third.status, 200)

    @async_test
    async def test_a_stream_paused_for_write_stall_timeout_is_cut(self) -> None:
        self.start(server={"ping_interval": 10, "write_stall_timeout": 0.2})
        stream = self.stream()
        await stream.until_text("event: snapshot")
        page = self.servers.gateway.app.status_page  # type: ignore[union-attr]
        (subscriber,) = page.subscribers
        subscriber.pauseProducing()  # as twisted.web does when the socket buffer is full
        await stream.closed.addTimeout(PROMPTLY, reactor)
        self.assertEqual(page.subscribers, set())
