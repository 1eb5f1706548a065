"""`tokens_per_day` (quotas.py): counted as requests finish, checked before one waits; in memory
on a `Clock`, seeded from a real ledger, and shared by two gateways through a real Redis."""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from homelab_gateway.config import ClusterConfig
from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.quota import WINDOW
from homelab_gateway.ledger import Ledger
from homelab_gateway.line.cluster import Cluster
from homelab_gateway.line.tokens import RedisTokens
from homelab_gateway.quotas import Local, Quotas, Shared
from tests.test_ledger import NOON, record
from testsupport.helpers import wait_for
from testsupport.redis_server import RedisServer

_prefixes = itertools.count()


class InMemory(TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000.4)
        self.quotas = Quotas({"alice": 100}, Local(self.clock))

    async def refusal(self) -> GatewayError:
        try:
            await self.quotas.check(record(client="alice"))
        except GatewayError as e:
            return e
        self.fail("not refused")

    async def test_the_request_that_finds_the_quota_spent_is_told_the_second_it_may_return(
        self,
    ) -> None:
        await self.quotas.check(record(client="alice"))
        self.quotas.add(record(client="alice", input_tokens=70, output_tokens=29))
        await self.quotas.check(record(client="alice"))  # 99 of 100: it may still run over
        self.quotas.add(record(client="alice", input_tokens=1, output_tokens=0))
        self.clock.advance(9.9)  # 1010.3: the tokens of second 1000 leave at 1001 + a day
        error = await self.refusal()
        self.assertEqual((error.status, error.retry_after), (429, 86_391))
        self.assertEqual(
            (error.error_type, error.openai_body()["error"]["code"]),
            ("rate_limit_error", "rate_limit_exceeded"),
        )
        self.assertIn("try again in 86391s", error.message)
        self.clock.advance(86_390.6)  # 1000.9 + a day: not yet
        self.assertEqual((await self.refusal()).retry_after, 1)
        self.clock.advance(0.1)
        await self.quotas.check(record(client="alice"))
        self.assertEqual(self.quotas.status(), {"alice": {"tokens_per_day": 100, "tokens_used": 0}})

    async def test_others_and_requests_that_never_held_a_slot_are_not_counted(self) -> None:
        self.quotas.add(record(client="bob", input_tokens=500))
        self.quotas.add(record(client="alice", input_tokens=500, slot_seconds=None))
        await self.quotas.check(record(client="alice"))
        await self.quotas.check(record(client="bob"))
        self.assertEqual(self.quotas.status()["alice"]["tokens_used"], 0)

    async def test_a_slot_is_granted_only_while_the_running_requests_reservations_fit(
        self,
    ) -> None:
        first, second, third = (record(client="alice", input_tokens=30) for _ in range(3))
        for running in (first, second):
            await self.quotas.check(running)
            await self.quotas.check(third)  # arrived with them: let in to wait for a slot
            await self.quotas.admit(running, 20)  # 30 in, at most 20 out: 50 reserved
        try:
            await self.quotas.admit(third, 20)  # 100 reserved by the two running
        except GatewayError as e:
            self.assertEqual((e.status, e.retry_after, e.outcome), (429, 5, "rejected_quota"))
            self.assertIn("running requests", e.message)
        else:
            self.fail("a third request overran the day")
        self.assertEqual(set(self.quotas.running["alice"]), {id(first), id(second)})
        with self.assertRaises(GatewayError):
            await self.quotas.check(record(client="alice"))  # nor does one arriving now wait
        first.output_tokens = 5
        self.quotas.add(first)  # spent 35 of its 50
        await self.quotas.admit(third, 20)  # 35 spent and 50 reserved: 85 of 100
        for done in (second, third):
            self.quotas.add(done)
        self.assertEqual(self.quotas.running, {})
        self.assertEqual(self.quotas.status()["alice"]["tokens_used"], 35 + 50 + 50)


class Seeded(TestCase):
    async def test_a_restart_counts_the_days_hours_from_the_ledger_as_spent_at_their_end(
        self,
    ) -> None:
        path = Path(tempfile.mkdtemp(prefix="hg-quota-"))
        self.addCleanup(shutil.rmtree, path)
        clock = Clock()
        clock.advance(NOON + 1800)
        ledger = Ledger(str(path / "usage.sqlite3"), 90, clock)
        self.addCleanup(ledger.stop)
        ledger.add(record(client="alice", input_tokens=60, output_tokens=40))
        ledger.add(record(client="carol", input_tokens=60, output_tokens=40))
        clock.advance(WINDOW - 3600)  # the next day, 11:30: that hour is still in the window
        store = Local(clock)
        await store.seed(ledger, {"alice": 100})
        quotas = Quotas({"alice": 100}, store)
        self.assertEqual(quotas.status()["alice"]["tokens_used"], 100)
        try:
            await quotas.check(record(client="alice"))
        except GatewayError as e:
            self.assertEqual(e.retry_after, 5400, "its hour ended at 13:00, a day before 13:00")
        else:
            self.fail("not refused")
        self.assertEqual(store.known("carol"), 0, "only limited clients are seeded")
        reading = Deferred.fromCoroutine(store.seed(ledger, {"alice": 100}))  # a reload
        ledger.add(record(client="alice", input_tokens=5, output_tokens=0))
        store.spend("alice", 5)  # finished while the ledger is read
        await reading
        self.assertEqual(store.known("alice"), 105, "the ledger's day, never counted twice")


class InRedis(TestCase):
    async def test_two_gateways_share_one_quota_and_a_blip_loses_no_tokens(self) -> None:
        redis = RedisServer()
        redis.start()
        self.addCleanup(redis.close)
        prefix = f"q{next(_prefixes)}:"
        gateways = []
        for name in ("gw0", "gw1"):
            cluster = Cluster(
                ClusterConfig(host="127.0.0.1", port=redis.port, instance=name, prefix=prefix),
                reactor,
            )
            cluster.start()
            self.addCleanup(lambda c=cluster: Deferred.fromCoroutine(c.stop()))
            gateways.append((cluster, Quotas({"alice": 100}, Shared(RedisTokens(cluster)))))
        await wait_for(lambda: all(c.live for c, _ in gateways), what="both linked")
        (one, a), (_, b) = gateways
        a.add(record(client="alice", input_tokens=60, output_tokens=0))
        # After a's spend: one connection.
        await RedisTokens(one).tokens_call("spent", "alice", WINDOW, 1)
        await b.check(record(client="alice"))
        self.assertEqual(b.status()["alice"]["tokens_used"], 60, "b sees a's tokens")
        commands, one._commands = one._commands, None  # a cut off from Redis
        a.add(record(client="alice", input_tokens=40, output_tokens=0))
        await a.check(record(client="alice"))  # unknown: let by
        one._commands = commands
        for quotas in (a, b):  # a's next check sends what it could not, before it asks
            try:
                await quotas.check(record(client="alice"))
            except GatewayError as e:
                self.assertEqual(e.status, 429)
                self.assertLessEqual(abs(e.retry_after - WINDOW), 2, e.retry_after)
            else:
                self.fail("the tokens spent while cut off were lost")
        self.assertEqual(a.store.unsent, {})

    async def test_a_long_day_is_read_a_page_at_a_time_and_only_what_must_leave(self) -> None:
        redis = RedisServer()
        redis.start()
        self.addCleanup(redis.close)
        prefix = f"q{next(_prefixes)}:"
        cluster = Cluster(
            ClusterConfig(host="127.0.0.1", port=redis.port, instance="gw", prefix=prefix),
            reactor,
        )
        cluster.start()
        self.addCleanup(lambda: Deferred.fromCoroutine(cluster.stop()))
        await wait_for(lambda: cluster.live, what="linked")
        now = int(float((await cluster._commands.time())[0]))
        start = now - 1000
        key = f"{prefix}tokens:bob"
        await cluster._commands.rpush(key, [f"{start + i}:1" for i in range(250)])
        await cluster._commands.set(f"{key}:total", 250)
        quotas = Quotas({"bob": 100}, Shared(RedisTokens(cluster)))
        try:
            await quotas.check(record(client="bob"))
        except GatewayError as e:
            wait = start + 150 + 1 + WINDOW - now  # 151 must leave for 99 to stay
            self.assertLessEqual(abs(e.retry_after - wait), 1, (e.retry_after, wait))
        else:
            self.fail("not refused")
        self.assertEqual(quotas.status()["bob"]["tokens_used"], 250)
