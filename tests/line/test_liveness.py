"""Whether Redis answers (`core.liveness`, and the cluster's watchdog on a `Clock`): judged from
Redis's replies, not from how late a saturated reactor got round to reading them."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock, LoopingCall
from twisted.trial.unittest import TestCase

from homelab_gateway.config import ClusterConfig
from homelab_gateway.core.liveness import Liveness
from homelab_gateway.line.cluster import WATCH_STEP, Cluster, Watched


class Counting(TestCase):
    def test_silence_counts_only_while_a_command_waits_and_at_most_a_step_per_turn(self) -> None:
        link = Liveness(timeout=1.0, step=0.25)
        self.assertFalse(link.tick(0.0))
        self.assertFalse(link.tick(100.0), "nothing asked: an idle link is no silent one")
        link.asked()
        self.assertFalse(link.tick(160.0), "a turn a minute late counts one step")
        self.assertEqual(link.silent, 0.25)
        link.answered()
        self.assertEqual((link.waiting, link.silent), (0, 0.0))
        link.asked()
        for n in range(1, 4):
            self.assertFalse(link.tick(160.0 + n * 0.25))
        self.assertTrue(link.tick(161.0), "four steady turns without an answer: a second")


class FakeRedis:
    """A connection whose replies the test sends."""

    def __init__(self) -> None:
        self.pending: list[Deferred[Any]] = []
        self.dropped = False

    def get(self, key: str) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.pending.append(d)
        return d

    def disconnect(self) -> Deferred[None]:
        self.dropped = True
        return succeed(None)


class Watchdog(TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.cluster = Cluster(ClusterConfig(host="redis", lease=2.0), self.clock)
        self.redis, self.reader = FakeRedis(), FakeRedis()
        commands, reader = Liveness(1.0, WATCH_STEP), Liveness(2.0, WATCH_STEP)
        self.cluster._commands = Watched(self.redis, commands)
        self.cluster._reader = Watched(self.reader, reader)
        watchdog = self.cluster._watchdog = LoopingCall(self.cluster._watch, commands, reader)
        watchdog.clock = self.clock
        watchdog.start(WATCH_STEP)
        self.addCleanup(lambda: watchdog.running and watchdog.stop())

    def test_a_reactor_seconds_late_to_read_a_prompt_reply_keeps_the_link(self) -> None:
        for _ in range(20):
            self.cluster._commands.get("lease")
            self.clock.advance(5.0)  # a burst held the reactor; the reply waited in its socket
            self.redis.pending.pop().callback("ok")
        self.assertFalse(self.redis.dropped, "100 s of lag, and Redis answered every time")

    def test_redis_silent_while_the_reactor_turns_drops_the_link_within_its_timeout(
        self,
    ) -> None:
        self.cluster._commands.get("lease")
        self.clock.pump([WATCH_STEP] * 3)
        self.assertFalse(self.redis.dropped)
        self.clock.advance(WATCH_STEP)
        self.assertTrue(self.redis.dropped and self.reader.dropped)
        self.assertEqual(self.cluster.last_error, "Redis did not answer for 1s")
