"""The line's contract, held by both of its implementations: in process
(`limiter.PositionedSemaphore`, one gateway) and shared through a real Redis
(`shared.RedisSource`, here three gateways' copies in this process, each with its own
`Cluster`, its own connections and its own instance id). Then what only the shared line has:
a gateway that dies, one that stops cleanly, Redis going away and coming back empty."""

from __future__ import annotations

import itertools
import random
from typing import Any

import orjson
from twisted.internet import reactor
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import deferLater
from twisted.logger import LogLevel, formatEvent
from twisted.trial.unittest import TestCase

from homelab_gateway.config import ClusterConfig
from homelab_gateway.core.line import CLASS_RANK
from homelab_gateway.line.cluster import BACKOFF, SETTLE, Cluster
from homelab_gateway.line.limiter import PositionedSemaphore, Replica, Slot
from homelab_gateway.line.refusals import Unavailable
from homelab_gateway.line.shared import shared_line
from tests.surfaces.test_proxy import async_test
from testsupport.helpers import PATIENCE, PROMPTLY, capture_log, wait_for
from testsupport.redis_server import RedisServer

REPORT = 0.05  # position passes in these tests: falls are told this soon
LEASE = 1.5
_prefixes = itertools.count()


class Waiter:
    """One request for a slot, with the positions it was told."""

    def __init__(
        self, line: PositionedSemaphore, name: str, client: str = "c", cls: str = "normal"
    ) -> None:
        self.name = name
        self.positions: list[int] = []
        self.d: Deferred[Slot] = line.acquire_in_line(
            self.positions.append, client=client, rank=CLASS_RANK[cls]
        )
        self.d.addErrback(self._failed)
        self.error: Exception | None = None

    def _failed(self, failure: Any) -> None:
        self.error = failure.value

    @property
    def slot(self) -> Slot | None:
        result = getattr(self.d, "result", None)
        return result if isinstance(result, Slot) else None


class InProcess:
    """One gateway: every 'gateway' of a test is the same in-process line."""

    async def start(self, test: TestCase, gateways: int, slots: int) -> list[PositionedSemaphore]:
        line = PositionedSemaphore([Replica("vllm", slots)], reactor, report_interval=REPORT)
        test.addCleanup(line.close)
        return [line] * gateways

    async def settle(self) -> None:
        """Nothing to wait for: the in-process line changes synchronously."""


class OverRedis:
    """Several gateways' copies of one line, shared through a real redis-server."""

    redis: RedisServer

    async def start(
        self, test: TestCase, gateways: int, slots: int, share: float = 0.0, grace: float = 30.0
    ) -> list[PositionedSemaphore]:
        self.redis = RedisServer()
        self.redis.start()
        test.addCleanup(self.redis.close)
        self.prefix = f"t{next(_prefixes)}:"
        self.clusters: list[Cluster] = []
        lines: list[PositionedSemaphore] = []
        for n in range(gateways):
            lines.append(self.gateway(test, f"gw{n}", slots, share, grace))
        await wait_for(lambda: all(c.live for c in self.clusters), what="every gateway linked")
        return lines

    def gateway(
        self, test: TestCase, name: str, slots: int, share: float, grace: float = 30.0
    ) -> PositionedSemaphore:
        config = ClusterConfig(
            host="127.0.0.1",
            port=self.redis.port,
            instance=name,
            lease=LEASE,
            prefix=self.prefix,
            fallback_share=share,
            outage_grace=grace,
        )
        cluster = Cluster(config, reactor)
        line = shared_line(
            [Replica("vllm", slots)], reactor, cluster=cluster, report_interval=REPORT
        )
        cluster.start()
        self.clusters.append(cluster)
        test.addCleanup(line.close)
        test.addCleanup(lambda: Deferred.fromCoroutine(cluster.stop()))
        return line

    async def settle(self) -> None:
        """Until every copy has replayed every event and no claim is out, twice in a row."""
        calm = 0
        while calm < 2:
            seq = int(await self.clusters[0]._commands.get(self.prefix + "seq") or 0)
            await wait_for(lambda seq=seq: self._caught_up(seq), what="every copy up to date")
            again = int(await self.clusters[0]._commands.get(self.prefix + "seq") or 0)
            calm = calm + 1 if again == seq else 0

    def _caught_up(self, seq: int) -> bool:
        return all(
            c._seq >= seq
            and not c._awaiting  # a new line's snapshot, and the events kept for after it
            and not any(line._claiming for line in c.lines.values())
            for c in self.clusters
            if c.live
        )


class LineContract:
    """What a demanding user sees of the line, whichever implementation serves it."""

    backend: Any

    def setUp(self) -> None:
        self.backend = self.backend_type()

    async def line_of(self, gateways: int, slots: int) -> list[PositionedSemaphore]:
        return await self.backend.start(self, gateways, slots)

    async def queue(
        self, lines: list[PositionedSemaphore], n: int, name: str = "w", **kw: Any
    ) -> list[Waiter]:
        """`n` waiters joining one after another, round the gateways."""
        waiters = []
        for i in range(n):
            waiters.append(Waiter(lines[i % len(lines)], f"{name}{i}", **kw))
            await self.backend.settle()
        return waiters

    def granted(self, waiters: list[Waiter]) -> list[str]:
        return [w.name for w in waiters if w.slot is not None and not w.slot.released]

    @async_test
    async def test_the_cap_holds_and_one_client_is_served_in_order(self) -> None:
        lines = await self.line_of(3, 2)
        waiters = await self.queue(lines, 8)
        self.assertEqual(self.granted(waiters), ["w0", "w1"])
        for line in lines:
            self.assertEqual((line.in_use, len(line.waiting)), (2, 6))
        self.assertEqual([w.positions for w in waiters[2:]], [[1], [2], [3], [4], [5], [6]])
        order = []
        for _ in range(8):
            first = next(w for w in waiters if w.slot is not None and not w.slot.released)
            order.append(first.name)
            first.slot.release()  # type: ignore[union-attr]
            await self.backend.settle()
            self.assertLessEqual(len(self.granted(waiters)), 2)
        self.assertEqual(order, [f"w{i}" for i in range(8)])
        await wait_for(lambda: all(w.positions[-1] == 1 for w in waiters[2:]))
        for w in waiters[2:]:
            self.assertEqual(w.positions, sorted(w.positions, reverse=True), w.name)
        for line in lines:
            self.assertEqual((line.in_use, len(line.waiting)), (0, 0))

    @async_test
    async def test_requests_at_the_same_moment_on_every_gateway_never_pass_the_cap(self) -> None:
        lines = await self.line_of(3, 2)
        waiters = [Waiter(lines[i % 3], f"w{i}") for i in range(12)]  # no settling between
        await self.backend.settle()
        self.assertEqual(len(self.granted(waiters)), 2)
        for line in lines:
            self.assertEqual((line.in_use, len(line.waiting)), (2, 10))
        for _ in range(5):
            for slot in [w.slot for w in waiters if w.slot is not None and not w.slot.released]:
                slot.release()
            await self.backend.settle()
            self.assertEqual(len(self.granted(waiters)), 2)
        positions = sorted(w.positions[0] for w in waiters if w.positions)
        self.assertEqual(positions, list(range(1, 11)))

    @async_test
    async def test_a_quiet_client_goes_before_a_busy_clients_backlog(self) -> None:
        lines = await self.line_of(2, 1)
        busy = await self.queue(lines, 4, client="busy")
        quiet = await self.queue(lines[1:], 1, "q", client="quiet")
        self.assertEqual(quiet[0].positions, [1])
        busy[0].slot.release()  # type: ignore[union-attr]
        await self.backend.settle()
        self.assertEqual(self.granted(busy + quiet), ["q0"])
        quiet[0].slot.release()  # type: ignore[union-attr]
        await self.backend.settle()
        self.assertEqual(self.granted(busy), ["w1"])

    @async_test
    async def test_interactive_goes_first(self) -> None:
        lines = await self.line_of(2, 1)
        normal = await self.queue(lines, 3)
        urgent = await self.queue(lines[1:], 1, "u", cls="interactive")
        self.assertEqual(urgent[0].positions, [1])
        await wait_for(lambda: normal[2].positions[-1] == 3, what="the last normal moved back")
        normal[0].slot.release()  # type: ignore[union-attr]
        await self.backend.settle()
        self.assertIsNotNone(urgent[0].slot)

    @async_test
    async def test_a_waiter_that_leaves_moves_those_behind_it_up_and_gets_nothing(self) -> None:
        lines = await self.line_of(2, 1)
        waiters = await self.queue(lines, 4)
        waiters[1].d.cancel()
        self.assertIsInstance(waiters[1].error, CancelledError)
        await self.backend.settle()
        for line in lines:
            self.assertEqual(len(line.waiting), 2)
        await wait_for(lambda: [w.positions[-1] for w in waiters[2:]] == [1, 2])
        waiters[0].slot.release()  # type: ignore[union-attr]
        await self.backend.settle()
        self.assertEqual(self.granted(waiters), ["w2"])
        self.assertEqual(waiters[1].positions, [1])

    @async_test
    async def test_a_client_at_its_max_in_flight_is_passed_over_in_place_on_every_gateway(
        self,
    ) -> None:
        lines = await self.line_of(3, 3)
        for line in lines:
            line.configure_line(aging=None, weights={}, max_waiting={}, max_in_flight={"a": 1})
        batch = [Waiter(lines[i % 3], f"a{i}", client="a") for i in range(4)]  # no settling
        await self.backend.settle()
        self.assertEqual(len(self.granted(batch)), 1, "two slots are free, a holds its one")
        others = await self.queue(lines, 2, "b", client="b")
        self.assertEqual(self.granted(others), ["b0", "b1"])
        for line in lines:
            self.assertEqual((line.in_use, len(line.waiting)), (3, 3))
            self.assertEqual(line.dispatch.in_flight, {"a": 1, "b": 2})
        late = await self.queue(lines[1:], 1, "c", client="c")
        self.assertEqual(late[0].positions, [1], "ahead of a's waiters")
        await wait_for(
            lambda: sorted(w.positions[-1] for w in batch if w.slot is None) == [2, 3, 4]
        )
        for w in others:
            w.slot.release()  # type: ignore[union-attr]
        await self.backend.settle()
        self.assertEqual(len(self.granted(batch)), 1, "still one of a's, beside c's")
        self.assertEqual(self.granted(late), ["c0"])
        order = []
        for _ in range(4):
            (held,) = [w for w in batch if w.slot is not None and not w.slot.released]
            order.append(held.name)
            held.slot.release()  # type: ignore[union-attr]
            await self.backend.settle()
        self.assertEqual(len(set(order)), 4, "each of a's ran, one at a time, alone at the end")
        for line in lines:
            self.assertEqual((line.in_use, len(line.waiting)), (1, 0))


class InProcessLine(LineContract, TestCase):
    backend_type = InProcess


class SharedLine(LineContract, TestCase):
    backend_type = OverRedis


def cut_off(cluster: Cluster) -> None:
    """What `kill -9` does to a gateway, as Redis sees it: its connections drop, its lease is
    never renewed nor deleted."""
    cluster._running = False
    if cluster._renewal is not None and cluster._renewal.running:
        cluster._renewal.stop()
    for connection in (cluster._reader, cluster._commands):
        for protocol in connection.connection._factory.pool:
            protocol.transport.abortConnection()


class SharedOnly(TestCase):
    def setUp(self) -> None:
        self.backend = OverRedis()

    @async_test
    async def test_a_dead_gateways_slot_and_waiters_expire_within_the_lease(self) -> None:
        a, b = await self.backend.start(self, 2, 1)
        held = Waiter(b, "held")
        await self.backend.settle()
        Waiter(b, "b1")
        await self.backend.settle()
        behind_a = Waiter(a, "a1")
        await self.backend.settle()
        self.assertEqual(behind_a.positions, [2])
        cut_off(self.backend.clusters[1])
        await wait_for(lambda: behind_a.slot is not None, timeout=LEASE * 4 + PATIENCE / 4)
        self.assertEqual((a.in_use, len(a.waiting)), (1, 0))
        self.assertEqual(behind_a.positions[-1], 1)
        self.assertIsNotNone(held.slot)

    @async_test
    async def test_a_clean_stop_gives_its_share_back_at_once(self) -> None:
        a, b = await self.backend.start(self, 2, 1)
        held = Waiter(b, "held")
        await self.backend.settle()
        behind = Waiter(a, "a1")
        await self.backend.settle()
        b.fail_waiting(Unavailable("stopping"))
        held.slot.release()  # type: ignore[union-attr]
        started = reactor.seconds()
        await self.backend.clusters[1].stop()
        await wait_for(lambda: behind.slot is not None)
        self.assertLess(reactor.seconds() - started, LEASE)

    @async_test
    async def test_a_clean_stop_sweeps_its_own_share_alone(self) -> None:
        """Another gateway's lease ran out in a pause of Redis, and it has not renewed it yet:
        a gateway stopping then takes nothing of what the other still runs."""
        _, b = await self.backend.start(self, 2, 2)
        held = Waiter(b, "held")
        await self.backend.settle()
        assert held.slot is not None
        other = self.backend.clusters[1]
        other._renewal.stop()  # type: ignore[union-attr]
        self.backend.redis.command("DEL", other.lease_key)
        await self.backend.clusters[0].stop()
        slots = self.backend.prefix + "upstream:vllm:slots"
        self.assertEqual(self.backend.redis.command("HLEN", slots), 1)
        self.assertEqual(b.in_use, 1)

    @async_test
    async def test_a_stop_while_events_come_gives_its_share_back_and_loses_nothing(
        self,
    ) -> None:
        """The reader's XREAD answers (another gateway's event, sent as the stop begins) while
        the stop gives the share back: the stop is no lost line, and its sweep is not cut
        off."""
        await self.backend.start(self, 1, 2)
        cluster = self.backend.clusters[0]
        said = capture_log(self)
        await wait_for(lambda: cluster._reader.liveness.waiting == 1, what="XREAD blocked")
        stopped = Deferred.fromCoroutine(cluster.stop())
        event = orjson.dumps({"n": cluster._seq + 1, "l": "another line"}).decode()
        self.backend.redis.command("XADD", cluster.key("events"), "*", "e", event)
        await stopped
        warned = [formatEvent(e) for e in said if e.get("log_level") >= LogLevel.warn]
        self.assertEqual(warned, [])
        self.assertIsNone(cluster._grace)
        self.assertEqual(self.backend.redis.command("EXISTS", cluster.lease_key), 0)

    @async_test
    async def test_a_stop_while_rejoining_leaves_no_lease_and_no_timer(self) -> None:
        """The stop comes while the snapshot is read; its reply lands as the stop closes the
        reader (a TLS close takes a round trip), and the rejoin goes on to link."""
        redis = RedisServer()
        redis.start()
        self.addCleanup(redis.close)
        config = ClusterConfig(
            host="127.0.0.1", port=redis.port, instance="gw", lease=5.0, prefix="j:"
        )
        cluster = Cluster(config, reactor)
        stopping: list[Deferred[None]] = []
        evaluate = cluster._eval

        async def snapshot_then_stop(name: str, keys: Any, args: Any) -> Any:
            d = Deferred.fromCoroutine(evaluate(name, keys, args))
            if name == "snapshot" and not stopping:
                reader = cluster._reader.connection
                close = reader.disconnect

                async def slow_close() -> None:
                    await deferLater(reactor, 0.05, lambda: None)
                    await close()

                reader.disconnect = slow_close
                stopping.append(Deferred.fromCoroutine(cluster.stop()))
            return await d

        cluster._eval = snapshot_then_stop  # type: ignore[method-assign]
        cluster.start()
        await wait_for(lambda: bool(stopping), what="a stop while the snapshot is read")
        await stopping[0]
        grace = cluster._grace
        if grace is not None:
            grace.cancel()
        self.assertIsNone(grace, "a grace timer started after the stop")
        self.assertEqual(redis.command("EXISTS", cluster.lease_key), 0, "the lease left")

    @async_test
    async def test_redis_away_keeps_every_place_and_restarted_empty_serves_them_in_order(
        self,
    ) -> None:
        a, b = await self.backend.start(self, 2, 2)
        running = Waiter(a, "running")
        await self.backend.settle()
        other = Waiter(b, "other")
        await self.backend.settle()
        waiting = Waiter(b, "waiting")
        await self.backend.settle()
        self.assertEqual(waiting.positions, [1])
        other.slot.release()  # type: ignore[union-attr]
        await self.backend.settle()
        late = Waiter(a, "late", client="x")
        await self.backend.settle()
        self.assertEqual(late.positions, [1])

        self.backend.redis.stop()
        await wait_for(lambda: not any(c.live for c in self.backend.clusters), what="lost")
        self.assertIsNone(late.error)
        self.assertFalse(running.slot.released)  # type: ignore[union-attr]
        after = Waiter(b, "after", client="y")  # joins behind, told its place
        self.assertEqual((late.positions[-1], after.positions), (1, [2]))
        self.assertEqual((a.in_use, b.in_use), (2, 2), "each copy as it was: nothing granted")

        self.backend.redis.start()  # on the same port, with none of its data
        await wait_for(lambda: all(c.live for c in self.backend.clusters), what="relinked")
        await self.backend.settle()
        self.assertEqual((a.in_use, b.in_use), (2, 2))  # both counted again, by everyone
        for line in (a, b):
            self.assertEqual(len(line.waiting), 2, "both joined again")
        running.slot.release()  # type: ignore[union-attr]
        # No grant until every gateway could count its running requests again (SETTLE).
        await wait_for(lambda: late.slot is not None, timeout=SETTLE + PATIENCE)
        self.assertIsNone(after.slot, "the first to arrive goes first")
        await wait_for(lambda: after.positions[-1] == 1, what="after to be told it is next")
        waiting.slot.release()  # type: ignore[union-attr]
        await wait_for(lambda: after.slot is not None)
        for w in (late, after):
            w.slot.release()  # type: ignore[union-attr]
        await self.backend.settle()
        self.assertEqual((a.in_use, b.in_use), (0, 0))
        for name in ("vllm",):
            key = f"{self.backend.prefix}upstream:{name}:slots"
            self.assertEqual(await self.backend.clusters[0]._commands.hlen(key), 0)

    @async_test
    async def test_past_the_outage_grace_waiters_get_529_and_new_requests_at_once(
        self,
    ) -> None:
        (a,) = await self.backend.start(self, 1, 1, grace=0.5)
        running = Waiter(a, "running")
        await self.backend.settle()
        waiting = Waiter(a, "waiting")
        await self.backend.settle()
        self.backend.redis.stop()
        await wait_for(lambda: not self.backend.clusters[0].live, what="lost")
        self.assertIsNone(waiting.error)
        Waiter(a, "joins")  # within the grace: it waits too
        await wait_for(lambda: isinstance(waiting.error, Unavailable), what="the grace to end")
        self.assertIn("out of reach for 0.5s", str(waiting.error))
        self.assertEqual(len(a.waiting), 0)
        with self.assertRaises(Unavailable):
            a.acquire_in_line(client="c")
        self.backend.redis.start()
        await wait_for(lambda: self.backend.clusters[0].live, what="relinked")
        running.slot.release()  # type: ignore[union-attr]
        await wait_for(lambda: a.in_use == 0, timeout=SETTLE + PATIENCE)
        newcomer = Waiter(a, "newcomer")
        await wait_for(lambda: newcomer.slot is not None, timeout=SETTLE + PATIENCE)
        newcomer.slot.release()  # type: ignore[union-attr]
        await self.backend.settle()

    @async_test
    async def test_a_fallback_share_keeps_each_gateway_serving_its_part_while_redis_is_away(
        self,
    ) -> None:
        a, b = await self.backend.start(self, 2, 2, share=0.5)
        run_a = Waiter(a, "run_a")
        await self.backend.settle()
        run_b = Waiter(b, "run_b")
        await self.backend.settle()
        wait_a = Waiter(a, "wait_a")
        await self.backend.settle()
        wait_b = Waiter(b, "wait_b")
        await self.backend.settle()
        self.assertEqual((wait_a.positions, wait_b.positions), ([1], [2]))

        self.backend.redis.stop()
        await wait_for(lambda: not any(c.live for c in self.backend.clusters), what="lost")
        # Each waits on for its gateway's half of the slots, first in its own line now.
        await wait_for(lambda: wait_b.positions[-1] == 1)
        self.assertIsNone(wait_a.error)
        self.assertIsNone(wait_b.error)
        late_a = Waiter(a, "late_a")
        self.assertEqual(late_a.positions, [2])
        run_a.slot.release()  # type: ignore[union-attr]
        self.assertIsNotNone(wait_a.slot)  # a's half: one slot, granted here
        self.assertIsNone(late_a.slot)
        self.assertEqual((a.in_use, b.in_use), (1, 1))

        self.backend.redis.start()
        await wait_for(lambda: all(c.live for c in self.backend.clusters), what="relinked")
        await self.backend.settle()
        # Redis counts both running slots again; the waiters are back in one line.
        self.assertEqual((a.in_use, b.in_use), (2, 2))
        self.assertEqual(sorted((len(a.waiting), len(b.waiting))), [2, 2])
        run_b.slot.release()  # type: ignore[union-attr]
        await wait_for(
            lambda: any(w.slot is not None for w in (wait_b, late_a)), timeout=SETTLE + PATIENCE
        )
        await self.backend.settle()
        self.assertEqual(sum(w.slot is not None for w in (wait_b, late_a)), 1)
        for w in (wait_a, wait_b, late_a):
            if w.slot is not None:
                w.slot.release()
            await self.backend.settle()
        for w in (wait_a, wait_b, late_a):
            if not w.slot.released:  # type: ignore[union-attr]
                w.slot.release()  # type: ignore[union-attr]
        await self.backend.settle()
        self.assertTrue(all(w.slot is not None for w in (wait_a, wait_b, late_a)))
        self.assertEqual((a.in_use, b.in_use, len(a.waiting)), (0, 0, 0))

    @async_test
    async def test_events_read_before_a_new_lines_snapshot_are_applied_after_it(self) -> None:
        """A reload's new line asks Redis for its snapshot and its waiters join at once: the
        joins' events can be read before the snapshot's answer, which does not count them."""
        (old,) = await self.backend.start(self, 1, 1)
        held = Waiter(old, "held")
        await self.backend.settle()
        waiter = Waiter(old, "waiter")
        await self.backend.settle()
        cluster = self.backend.clusters[0]
        evaluate = cluster._eval

        async def snapshot_late(name: str, keys: Any, args: Any) -> Any:
            reply = await evaluate(name, keys, args)
            if name == "snapshot":  # not before the reader has read the events after it:
                seq = int(reply[0])  # held-b's admit, the waiter's leave of old and its join
                await wait_for(lambda: cluster._seq >= seq + 3, what="the join's event read")
            return reply

        cluster._eval = snapshot_late  # type: ignore[method-assign]
        new = shared_line(
            [old.members[0], Replica("vllm-b", 1)], reactor, cluster=cluster, report_interval=REPORT
        )
        self.addCleanup(new.close)
        held_b = Waiter(new, "held-b")  # vllm-b's slot, so that the adopted waiter must wait
        new.adopt(old)
        await self.backend.settle()
        self.assertIsNotNone(held_b.slot)
        self.assertEqual((len(new.waiting), waiter.positions[-1]), (1, 1))
        held.slot.release()  # type: ignore[union-attr]
        await wait_for(lambda: waiter.slot is not None, what="the adopted waiter's slot")

    @async_test
    async def test_a_reload_that_gives_the_model_a_second_upstream_moves_the_waiters(
        self,
    ) -> None:
        (old,) = await self.backend.start(self, 1, 1)
        held = Waiter(old, "held")
        await self.backend.settle()
        first, second = Waiter(old, "first"), Waiter(old, "second")
        await self.backend.settle()
        self.assertEqual((first.positions, second.positions), ([1], [2]))
        cluster = self.backend.clusters[0]
        new = shared_line(
            [old.members[0], Replica("vllm-b", 1)], reactor, cluster=cluster, report_interval=REPORT
        )
        self.addCleanup(new.close)
        new.adopt(old)
        await self.backend.settle()
        self.assertEqual(first.slot.replica.name, "vllm-b")  # type: ignore[union-attr]
        await wait_for(lambda: second.positions[-1] == 1)
        self.assertEqual((len(old.waiting), len(new.waiting)), (0, 1))
        held.slot.release()  # type: ignore[union-attr]
        await self.backend.settle()
        self.assertEqual(second.slot.replica.name, "vllm")  # type: ignore[union-attr]
        for w in (first, second):
            w.slot.release()  # type: ignore[union-attr]
        await self.backend.settle()
        self.assertEqual((new.in_use, len(new.waiting)), (0, 0))

    @async_test
    async def test_a_gateway_started_before_redis_refuses_until_it_links_and_stops_at_once(
        self,
    ) -> None:
        self.backend.redis = RedisServer()
        self.addCleanup(self.backend.redis.close)
        self.backend.prefix = "early:"
        self.backend.clusters = []
        line = self.backend.gateway(self, "early", 1, 0.0)
        cluster = self.backend.clusters[0]
        await wait_for(lambda: cluster.last_error is not None, what="a refused connection")
        with self.assertRaises(Unavailable):
            line.acquire_in_line(client="c")
        self.backend.redis.start()
        await wait_for(lambda: cluster.live, timeout=BACKOFF[1] + PATIENCE)
        first = Waiter(line, "first")
        await self.backend.settle()
        self.assertIsNotNone(first.slot)
        first.slot.release()  # type: ignore[union-attr]
        await self.backend.settle()
        self.backend.redis.stop()
        await wait_for(lambda: not cluster.live and cluster._pause is not None)
        started = reactor.seconds()
        await cluster.stop()  # in the pause between two attempts: it ends the pause
        self.assertLess(reactor.seconds() - started, BACKOFF[0] * 2 + PROMPTLY)

    @async_test
    async def test_health_and_sessions_found_on_one_gateway_hold_on_every_gateway(
        self,
    ) -> None:
        a, b = await self.backend.start(self, 2, 2)
        for line in (a, b):
            line.members[0].circuit.failures_to_open = 1
        session = a.acquire_in_line(client="c", session="conversation-1")
        await self.backend.settle()
        self.assertEqual(b.sessions.get("conversation-1"), "vllm")
        slot = session.result
        refused = "upstream vllm unreachable: connection refused"
        slot.failed(refused)
        slot.release()
        await self.backend.settle()
        for line in (a, b):  # out of rotation everywhere, for the same cool-down
            circuit = line.members[0].circuit
            self.assertEqual(
                (circuit.state, circuit.last_error),
                ("down", "upstream vllm unreachable: connection refused"),
            )
        self.assertEqual(a.members[0].circuit.retry_at, b.members[0].circuit.retry_at)
        waiting = Waiter(b, "waiting")
        await self.backend.settle()
        self.assertIsNone(waiting.slot)  # nobody starts on a replica out of rotation
        a.recovered(a.members[0])  # a's probe reached it
        await self.backend.settle()
        self.assertEqual([line.members[0].circuit.state for line in (a, b)], ["up", "up"])
        self.assertIsNotNone(waiting.slot)
        waiting.slot.release()  # type: ignore[union-attr]
        await self.backend.settle()


class Agreement(TestCase):
    """Random joins, cancels and releases on three gateways at once: every copy of the line
    ends up the same line, and the whole history in Redis never had slot N+1 taken."""

    @async_test
    async def test_copies_agree_and_the_history_never_passes_the_cap(self) -> None:
        backend = OverRedis()
        lines = await backend.start(self, 3, 3)
        rng = random.Random(14)
        waiters: list[Waiter] = []
        for step in range(150):
            roll = rng.random()
            held = [w for w in waiters if w.slot is not None and not w.slot.released]
            pending = [w for w in waiters if not w.d.called]
            if roll < 0.5:
                client = rng.choice(["a", "b", "c"])
                cls = rng.choice(["interactive", "normal", "batch"])
                waiters.append(Waiter(rng.choice(lines), f"w{step}", client, cls))
            elif roll < 0.8 and held:
                rng.choice(held).slot.release()  # type: ignore[union-attr]
            elif pending:
                rng.choice(pending).d.cancel()
            if rng.random() < 0.2:
                await backend.settle()
        await backend.settle()
        now = lines[0].clock.seconds()
        orders = [[line.source._ids[item] for item in line.dispatch.order(now)] for line in lines]  # type: ignore[attr-defined]
        self.assertEqual(orders[0], orders[1])
        self.assertEqual(orders[0], orders[2])
        self.assertEqual(len({line.in_use for line in lines}), 1)
        if orders[0]:  # nobody waits while a slot is free
            self.assertEqual(lines[0].in_use, 3)
        while any(not w.d.called for w in waiters):
            for slot in [w.slot for w in waiters if w.slot is not None and not w.slot.released]:
                slot.release()
            await backend.settle()
        for slot in [w.slot for w in waiters if w.slot is not None and not w.slot.released]:
            slot.release()
        await backend.settle()
        self.assertEqual([(line.in_use, len(line.waiting)) for line in lines], [(0, 0)] * 3)
        history = await backend.clusters[0]._commands.execute_command(
            "XRANGE", backend.prefix + "events", "-", "+"
        )
        taken = peak = 0
        for _, fields in history:
            op = orjson.loads(fields[1])["op"]
            taken += {"admit": 1, "grant": 1, "restore": 1, "release": -1}.get(op, 0)
            peak = max(peak, taken)
        self.assertEqual((taken, peak), (0, 3))
