"""Whether Redis answers (`core.liveness`, and the cluster's watchdog on a `Clock`): judged from
Redis's replies, not from how late a saturated reactor got round to reading them. And what a
gateway whose link outlived a stall of Redis makes of the others' leases."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred, succeed
from twisted.internet.task import Clock, LoopingCall
from twisted.trial.unittest import TestCase

from homelab_gateway.config import ClusterConfig
from homelab_gateway.core.liveness import Liveness
from homelab_gateway.line.cluster import WATCH_STEP, Cluster, Watched
from homelab_gateway.line.scripts import SHAS


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


class Line:
    """What `Cluster._tick` asks of a line."""

    key = "vllm"
    member_names = ("vllm",)

    def lost(self) -> None:
        pass

    def refresh(self) -> None:
        pass


class Renewals(FakeRedis):
    """A link that outlived a stall: the lease's SET is answered when the test says; the
    scripts at once, each recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[str] = []

    def set(self, key: str, value: str, pexpire: int) -> Deferred[Any]:
        return self.get(key)

    def evalsha(self, sha: str, keys: Any, args: Any) -> Deferred[Any]:
        self.scripts.append(next(name for name, s in SHAS.items() if s == sha))
        return succeed(None)


class SweepAfterStall(TestCase):
    def test_a_renewal_redis_held_a_quarter_lease_sweeps_nobody_until_everyone_renewed(
        self,
    ) -> None:
        """Redis paused for 2/3 of a lease lets another gateway's lease run out; when it
        resumes, that gateway renews within its back-off. This one's link outlived the
        pause (its renewal waited a third of a lease, under the watchdog's half): its sweep
        must wait as after a rejoin, or the other's waiters get 529 and its slots go free
        while its requests still run."""
        clock = Clock()
        cluster = Cluster(ClusterConfig(host="redis", lease=3.0), clock)
        cluster._commands = redis = Renewals()
        cluster.add(Line())  # type: ignore[arg-type]

        def tick(held: float) -> None:
            ensureDeferred(cluster._tick())
            clock.advance(held)
            redis.pending.pop().callback("OK")

        clock.advance(cluster.settle)  # long linked
        tick(0.0)
        self.assertEqual(redis.scripts, ["sweep"])
        tick(1.0)  # Redis held the renewal for a third of the lease
        tick(0.0)
        clock.advance(cluster.settle - 1.5)
        tick(0.0)
        self.assertEqual(redis.scripts, ["sweep"], "nobody swept within settle of the stall")
        clock.advance(1.5)
        tick(0.0)
        self.assertEqual(redis.scripts, ["sweep", "sweep"])
