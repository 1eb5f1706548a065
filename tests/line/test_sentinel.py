"""Two gateways' shared line on a Redis that Sentinel manages (a real primary, replica and
Sentinel from Debian's redis-server): the primary is found through Sentinel, and killing it
mid-load ends with every waiter served through the promoted replica, the cap kept."""

from __future__ import annotations

import gc
import itertools
import json
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import txredisapi
from twisted.internet import reactor
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.logger import LogLevel, formatEvent
from twisted.trial.unittest import TestCase

from homelab_gateway.config import ClusterConfig
from homelab_gateway.line import cluster as cluster_module
from homelab_gateway.line.cluster import SETTLE, Cluster
from homelab_gateway.line.limiter import PositionedSemaphore, Replica
from homelab_gateway.line.sentinel import SWITCH, Primary, _Watch
from homelab_gateway.line.shared import shared_line
from tests.line.test_shared_line import Waiter
from tests.surfaces.test_proxy import async_test
from testsupport.helpers import (
    PATIENCE,
    Servers,
    capture_log,
    gateway_document,
    raw_request,
    wait_for,
)
from testsupport.redis_server import RedisServer, SentinelSet

_prefixes = itertools.count()


class Failover(TestCase):
    def gateway(self, sentinels: SentinelSet, name: str, prefix: str) -> PositionedSemaphore:
        config = ClusterConfig(
            host="",
            port=0,
            instance=name,
            lease=1.5,
            prefix=prefix,
            sentinels=(("127.0.0.1", sentinels.port),),
            sentinel_master=sentinels.MASTER,
        )
        cluster = Cluster(config, reactor)
        line = shared_line([Replica("vllm", 2)], reactor, cluster=cluster, report_interval=0.05)
        cluster.start()
        self.clusters.append(cluster)
        self.addCleanup(line.close)
        self.addCleanup(lambda: Deferred.fromCoroutine(cluster.stop()))
        return line

    @async_test
    async def test_the_primary_killed_mid_load_its_replica_serves_everyone_in_order(
        self,
    ) -> None:
        sentinels = SentinelSet()
        self.addCleanup(sentinels.close)
        prefix = f"s{next(_prefixes)}:"
        self.clusters: list[Cluster] = []
        a, b = self.gateway(sentinels, "gw-a", prefix), self.gateway(sentinels, "gw-b", prefix)
        await wait_for(lambda: all(c.live for c in self.clusters), what="both linked")
        self.assertEqual({c.address[1] for c in self.clusters}, {sentinels.primary.port})
        running = [Waiter(a, "r0"), Waiter(b, "r1")]
        await wait_for(lambda: all(w.slot is not None for w in running), what="both running")
        waiters = [Waiter((a, b)[i % 2], f"w{i}", client=f"c{i}") for i in range(4)]
        await wait_for(lambda: len(a.waiting) == len(b.waiting) == 4, what="four waiting")

        ids = {(a.source._ids.get(w.d) or b.source._ids.get(w.d)): w.name for w in waiters}
        before = [ids[a.source._ids[d]] for d in a.dispatch.order(reactor.seconds())]
        sentinels.primary.stop()  # SIGKILL: the replica is promoted in a few seconds
        promoted = sentinels.replica.port
        await wait_for(
            lambda: all(c.live and c.address[1] == promoted for c in self.clusters),
            timeout=20,
            what="both gateways linked to the promoted replica",
        )
        self.assertTrue(all(w.error is None for w in waiters), [w.error for w in waiters])
        for w in running:
            w.slot.release()  # type: ignore[union-attr]
        order = []
        for _ in range(2):  # two at a time, after the recount
            await wait_for(
                lambda: sum(w.slot is not None and not w.slot.released for w in waiters) == 2,
                timeout=SETTLE + PATIENCE,
                what="two waiters served",
            )
            served = [w for w in waiters if w.slot is not None and not w.slot.released]
            self.assertLessEqual(a.in_use, 2)
            order += sorted((w.name for w in served), key=before.index)
            for w in served:
                w.slot.release()  # type: ignore[union-attr]
        self.assertEqual(order, before, "in the order Redis had them before the failover")
        await wait_for(lambda: a.in_use == b.in_use == 0 and not a.waiting and not b.waiting)


class Sentinels:
    """Stands for the Sentinels of a gateway: they name `old` until they are told the
    failover, then `new` (after `stale` more answers naming `old`: a Sentinel yet to hear of
    it); the watch subscribes when `subscribed` fires. What the gateway asked of them, in
    order, is in `asked`."""

    def __init__(self, old: RedisServer, new: RedisServer) -> None:
        self.old = self.primary = old
        self.new = new
        self.stale = 0
        self.subscribed: Deferred[None] = succeed(None)
        self.asked: list[str] = []

    def fail_over(self, cluster: Cluster) -> None:
        self.primary = self.new
        cluster._switched(("127.0.0.1", self.new.port))

    async def watch(self) -> None:
        self.asked.append("watch")
        await self.subscribed

    async def find(self) -> tuple[str, int]:
        self.asked.append("find")
        if self.stale:
            self.stale -= 1
            return "127.0.0.1", self.old.port
        return "127.0.0.1", self.primary.port

    async def close(self) -> None:
        pass


class StaleAnswer(TestCase):
    def gateway(self, lease: float = 1.5) -> tuple[Cluster, Sentinels]:
        """A gateway whose Sentinels name the primary `old`, and can fail over to `new`."""
        old, new = RedisServer(), RedisServer()
        for server in (old, new):
            server.start()
            self.addCleanup(server.close)
        config = ClusterConfig(
            host="",
            port=0,
            instance="gw",
            lease=lease,
            prefix=f"s{next(_prefixes)}:",
            sentinels=(("127.0.0.1", 1),),
            sentinel_master="main",
        )
        cluster = Cluster(config, reactor)
        sentinels = Sentinels(old, new)
        cluster._primary = sentinels  # type: ignore[assignment]
        return cluster, sentinels

    def started(self, cluster: Cluster) -> None:
        cluster.start()
        self.addCleanup(lambda: Deferred.fromCoroutine(cluster.stop()))

    @async_test
    async def test_a_failover_told_while_connecting_to_the_old_primary_gives_that_up(
        self,
    ) -> None:
        """The Sentinels named the primary just before it paused; the failover is told while
        the connection waits on it. The gateway connects to the promoted one at once, not
        after its attempt's timeout (35 s at this lease), and never links to the old one, which
        resumed still calls itself primary (the cluster chaos run's cap bug: 6 at an upstream
        of 3, two gateways on the promoted primary and one on the old)."""
        cluster, sentinels = self.gateway(lease=20.0)
        old, new = sentinels.old, sentinels.new
        old.pause()
        self.addCleanup(old.resume)
        self.started(cluster)
        await wait_for(lambda: cluster.address[1] == old.port, what="asked the Sentinels")
        sentinels.fail_over(cluster)
        await wait_for(lambda: cluster.live, what="linked")
        self.assertEqual(cluster.address, ("127.0.0.1", new.port))
        old.resume()
        self.assertEqual(old.command("EXISTS", cluster.lease_key), 0, "nothing written there")
        self.assertEqual(sentinels.asked[:2], ["watch", "find"], "subscribed before asking")

    @async_test
    async def test_a_sentinel_yet_to_hear_of_the_failover_is_not_believed(self) -> None:
        """Linked to the old primary when a Sentinel tells the switch; the next Sentinel asked
        has not heard of it yet and names the old one, awake and calling itself primary."""
        cluster, sentinels = self.gateway(lease=10.0)
        self.started(cluster)
        await wait_for(lambda: cluster.live, what="linked")
        sentinels.stale = 1
        sentinels.fail_over(cluster)
        await wait_for(lambda: not cluster.live, what="the link dropped")
        await wait_for(lambda: cluster.live, what="linked again")
        self.assertEqual(cluster.address, ("127.0.0.1", sentinels.new.port))
        settling = sentinels.new.command("EXISTS", cluster.key("settling"))
        self.assertEqual(settling, 1, "no grants while every gateway counts its requests again")

    @async_test
    async def test_a_switch_told_between_two_attempts_is_acted_on_at_once(self) -> None:
        """The primary died: attempts to it are refused and the pause between them grows to
        its longest (a minute here). The switch cuts the pause short."""
        self.patch(cluster_module, "BACKOFF", (60.0, 60.0))
        cluster, sentinels = self.gateway()
        self.started(cluster)
        await wait_for(lambda: cluster.live, what="linked")
        sentinels.old.stop()
        await wait_for(lambda: cluster._pause is not None, what="a pause between attempts")
        sentinels.fail_over(cluster)
        await wait_for(lambda: cluster.live, what="linked to the promoted one")
        self.assertEqual(cluster.address, ("127.0.0.1", sentinels.new.port))

    @async_test
    async def test_a_stop_while_the_sentinels_are_asked_links_nothing(self) -> None:
        cluster, sentinels = self.gateway()
        sentinels.subscribed = Deferred()
        cluster.start()
        await wait_for(lambda: sentinels.asked == ["watch"], what="the watch subscribing")
        await cluster.stop()
        self.assertEqual(sentinels.asked, ["watch"])
        self.assertFalse(cluster.live)
        self.assertIsNone(cluster._grace)
        self.assertEqual(sentinels.old.command("EXISTS", cluster.lease_key), 0)


def watching(
    port: int,
    lease: float,
    on_switch: Callable[[tuple[str, int]], None],
    password: str | None = None,
) -> Primary:
    config = ClusterConfig(
        host="",
        port=0,
        lease=lease,
        sentinels=(("127.0.0.1", port),),
        sentinel_master="main",
        sentinel_password=password,
    )
    return Primary(config, reactor, on_switch)


class Watch(TestCase):
    """`Primary.watch` on a real server's publish and subscribe (a Sentinel's events are
    published the same way)."""

    @async_test
    async def test_it_returns_subscribed_and_tells_the_switches_of_its_primary(self) -> None:
        server = RedisServer()
        server.start()
        self.addCleanup(server.close)
        told: list[tuple[str, int]] = []
        primary = watching(server.port, 5.0, told.append)
        self.addCleanup(lambda: Deferred.fromCoroutine(primary.close()))
        await primary.watch()
        self.assertEqual(server.command("PUBLISH", SWITCH, "other 10.0.0.1 1 10.0.0.2 2"), 1)
        server.command("PUBLISH", SWITCH, "main 10.0.0.1 6379 10.0.0.2 6380")
        await wait_for(lambda: told == [("10.0.0.2", 6380)], what="the switch told")

    def test_no_subscription_within_a_lease_is_a_timeout(self) -> None:
        clock = Clock()
        primary = Primary(
            ClusterConfig(host="", lease=2.0, sentinels=(("sentinel", 1),)), clock, print
        )
        primary._watches = [_Watch(primary, None)]  # connecting, never subscribed
        d = Deferred.fromCoroutine(primary.watch())
        clock.advance(2.0)
        self.failureResultOf(d, TimeoutError)
        self.assertEqual(primary._waiting, [])

    @async_test
    async def test_a_silent_sentinel_leaves_no_unhandled_error(self) -> None:
        paused = RedisServer()
        paused.start()
        self.addCleanup(paused.close)
        paused.pause()
        self.addCleanup(paused.resume)
        primary = watching(paused.port, 0.5, print)
        with self.assertRaises(TimeoutError):
            await primary.watch()
        await primary.close()  # the subscription's reply never came
        gc.collect()  # an unhandled error in a Deferred is logged when it is collected
        self.assertEqual(self.flushLoggedErrors(), [])

    @async_test
    async def test_a_sentinel_refusing_the_password_is_told_once_per_connection(self) -> None:
        refusing = RedisServer()
        refusing.start()
        self.addCleanup(refusing.close)
        refusing.command("CONFIG", "SET", "requirepass", "secret")
        said = capture_log(self)
        primary = watching(refusing.port, 0.5, print, password="wrong")
        with self.assertRaises(TimeoutError):
            await primary.watch()
        with self.assertRaises(txredisapi.MasterNotFoundError):
            await primary.find()
        await primary.close()
        refused = [e for e in said if "refused the gateway" in formatEvent(e)]
        self.assertEqual(len(refused), 2, "the watch's connection and the question's")
        gc.collect()
        self.assertEqual(self.flushLoggedErrors(), [])


class NeverUp(TestCase):
    """`sentinels` pointing at a plain Redis: no primary is ever found. Every request is
    refused; the log says why at start and at most once a minute while it lasts, and the status
    says since when."""

    async def test_a_cluster_that_never_comes_up_says_so(self) -> None:
        redis = RedisServer()
        redis.start()
        self.addCleanup(redis.close)
        servers = Servers(self)
        document = gateway_document("http://127.0.0.1:9/v1")
        document["cluster"] = {
            "sentinels": [f"127.0.0.1:{redis.port}"],
            "sentinel_master": "mymaster",
            "lease": 0.5,
        }
        logged = capture_log(self)
        servers.start_gateway(document)
        cluster = servers.gateway.cluster
        assert cluster is not None
        attempts: list[float] = []  # attempts to connect begun
        connect = cluster._connect

        def counted() -> Any:
            attempts.append(reactor.seconds())
            return connect()

        cluster._connect = counted  # type: ignore[method-assign]
        started = time.time()
        cluster.start()

        def warnings() -> list[str]:
            return [
                formatEvent(e)
                for e in logged
                if e.get("log_level") == LogLevel.warn and "shared line" in formatEvent(e)
            ]

        await wait_for(lambda: len(attempts) >= 4, what="three attempts failed")
        self.assertEqual(len(warnings()), 1, warnings())
        self.assertIn("cannot reach the shared line", warnings()[0])
        self.assertIn("refused as overloaded", warnings()[0])

        response = raw_request(servers.gateway_port, "GET", "/llm/v1/status")
        await response.closed
        status = json.loads(response.body_text())["cluster"]
        self.assertEqual(status["redis"], "down")
        down_since = datetime.fromisoformat(status["down_since"]).timestamp()
        self.assertLess(abs(down_since - started), 2, status)

        assert cluster._warned_at is not None
        cluster._warned_at -= 60  # a minute later, and still down
        tried = len(attempts)
        await wait_for(lambda: len(attempts) >= tried + 2, what="one more attempt failed")
        self.assertEqual(len(warnings()), 2, warnings())
        self.assertIn("still out of reach", warnings()[1])
