"""Each client's `tokens_per_day`: counted as its requests finish, checked before one waits.

A request whose client has spent its quota in the rolling day (`core.quota`) is refused with a
429 and the seconds until enough of the day has passed; one that runs over finishes. A gateway
alone counts in memory, seeded at start from the usage ledger's hours (each hour's tokens as
if spent at its end, so nobody is let back early); gateways of a cluster count in Redis, one
hash of buckets per client, so each sees the others' usage. While Redis is out of reach the
check lets requests by (the shared line refuses them then, unless `fallback_share`), and what
was spent meanwhile is sent when it is back.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from homelab_gateway.core import quota
from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.usage import HOUR, UsageQuery
from homelab_gateway.line.cluster import LINK_FAILURES
from homelab_gateway.line.limiter import Unavailable
from homelab_gateway.line.tokens import RedisTokens

if TYPE_CHECKING:
    from homelab_gateway.ledger import Ledger

log = Logger()


class Store(Protocol):
    """Where the buckets are kept."""

    def spend(self, client: str, tokens: int) -> None: ...
    def wait(self, client: str, limit: int) -> Deferred[float | None]:
        """Seconds until `client`'s tokens in the window are below `limit`; None if they are."""

    def known(self, client: str) -> int | None:
        """The tokens in the window, as far as known without asking (for the status)."""


class Local:
    """The buckets of a gateway alone, in memory."""

    def __init__(self, clock: IReactorTime) -> None:
        self.clock = clock
        self.tally = quota.Tally()

    def spend(self, client: str, tokens: int) -> None:
        self.tally.add(client, tokens, self.clock.seconds())

    def wait(self, client: str, limit: int) -> Deferred[float | None]:
        return succeed(self.tally.retry_after(client, limit, self.clock.seconds()))

    def known(self, client: str) -> int:
        return self.tally.used(client, self.clock.seconds())

    async def seed(self, ledger: Ledger, clients: Mapping[str, int]) -> None:
        """The day's usage from the ledger, hour by hour, before any request is counted."""
        now = self.clock.seconds()
        rows = await ledger.rows(UsageQuery(since=now - quota.WINDOW, by=("client", "hour")))
        for row in rows:
            if row["client"] in clients:
                ended = datetime.fromisoformat(row["hour"]).timestamp() + HOUR
                tokens = row["input_tokens"] + row["output_tokens"]
                self.tally.add(row["client"], tokens, min(ended, now) - 1)


class Shared:
    """The buckets in the cluster's Redis. Tokens that could not be sent are sent with the
    next spend or check, as spent then."""

    def __init__(self, cluster: RedisTokens) -> None:
        self.cluster = cluster
        self.unsent: dict[str, int] = {}
        self._known: dict[str, int] = {}  # each client's tokens at its last check, and since

    def spend(self, client: str, tokens: int) -> None:
        self._known[client] = self._known.get(client, 0) + tokens
        tokens += self.unsent.pop(client, 0)
        sent = self.cluster.tokens_call("spend", client, quota.WINDOW, tokens)
        sent.addErrback(self._unsent, client, tokens)

    def _unsent(self, failure: Any, client: str, tokens: int) -> None:
        self.unsent[client] = self.unsent.get(client, 0) + tokens

    def wait(self, client: str, limit: int) -> Deferred[float | None]:
        for name, tokens in list(self.unsent.items()):  # Redis may be back
            del self.unsent[name]
            self.cluster.tokens_call("spend", name, quota.WINDOW, tokens).addErrback(
                self._unsent, name, tokens
            )
        asked = self.cluster.tokens_call("spent", client, quota.WINDOW, limit)
        return asked.addCallback(self._waited, client, limit)

    def _waited(self, reply: list[Any], client: str, limit: int) -> float | None:
        """The script's answer: Redis's time, the total, and the oldest buckets, as many as
        must leave for the total to be below `limit`."""
        now, total, flat = float(reply[0]), int(reply[1]), reply[2]
        self._known[client] = total
        oldest = (tuple(map(int, bucket.split(":"))) for bucket in flat)
        return quota.retry_after(oldest, total, limit, now)  # type: ignore[arg-type]

    def known(self, client: str) -> int | None:
        return self._known.get(client)


class Quotas:
    """The configured clients' `tokens_per_day`, and their usage in `store`."""

    def __init__(self, limits: Mapping[str, int], store: Store) -> None:
        self.limits = dict(limits)
        self.store = store

    def add(self, record: RequestRecord) -> None:
        """A finished request's tokens count against its client's quota, if it reached an
        upstream: held a slot (one refused before has only an estimate of its prompt)."""
        if record.client in self.limits and record.slot_seconds is not None:
            tokens = (record.input_tokens or 0) + (record.output_tokens or 0)
            if tokens > 0:
                self.store.spend(record.client, tokens)

    async def check(self, record: RequestRecord) -> None:
        """Raise a 429 if the request's client has spent its quota in the rolling day. A
        store out of reach lets it by: the quota is a budget, not the cap."""
        limit = self.limits.get(record.client)
        if limit is None:
            return
        try:
            wait = await self.store.wait(record.client, limit)
        except (Unavailable, *LINK_FAILURES) as e:
            log.warn("tokens_per_day of {client} not checked: {e}", client=record.client, e=e)
            return
        if wait is None:
            return
        seconds = max(1, int(-(-wait // 1)))
        raise GatewayError(
            429,
            f"client {record.client} has used its {limit} tokens of the last 24 hours; "
            f"please try again in {seconds}s",
            retry_after=seconds,
            outcome="rejected_quota",
        )

    def status(self) -> dict[str, dict[str, int | None]]:
        """Each limited client's quota and the tokens it used in the rolling day, as far as
        known here (in a cluster: at its last check here, and what this gateway counted since)."""
        return {
            client: {"tokens_per_day": limit, "tokens_used": self.store.known(client)}
            for client, limit in sorted(self.limits.items())
        }
