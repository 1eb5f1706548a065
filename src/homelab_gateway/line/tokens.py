"""Each client's tokens of the rolling day in the cluster's Redis, for `tokens_per_day`.

The quota's store in a cluster (`quotas.Shared`) reads and writes them here, through the
cluster's link: a list of buckets and their total per client (`scripts.SPEND`, `SPENT`).
"""

from __future__ import annotations

from twisted.internet.defer import Deferred

from homelab_gateway.line.cluster import Cluster


class RedisTokens:
    """The clients' token buckets in the cluster's Redis."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def tokens_call(self, script: str, client: str, *args: object) -> Deferred[object]:
        """Run `spend` or `spent` on `client`'s tokens; fails with Unavailable while the
        cluster is not linked."""
        keys = [self.cluster.key("tokens", client), self.cluster.key("tokens", client, "total")]
        return self.cluster.script(script, keys, list(args))
