"""Two gateways' shared line on a Redis that Sentinel manages (a real primary, replica and
Sentinel from Debian's redis-server): the primary is found through Sentinel, and killing it
mid-load ends with every waiter served through the promoted replica, the cap kept."""

from __future__ import annotations

import itertools

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase

from homelab_gateway.config import ClusterConfig
from homelab_gateway.line.cluster import SETTLE, Cluster
from homelab_gateway.line.limiter import PositionedSemaphore, Replica
from homelab_gateway.line.shared import shared_line
from tests.helpers import PATIENCE, wait_for
from tests.line.test_shared_line import Waiter
from tests.redis_server import SentinelSet
from tests.surfaces.test_proxy import async_test

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
