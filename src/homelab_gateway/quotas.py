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
from homelab_gateway.core.usage import HOUR, UsageQuery, charged
from homelab_gateway.line.cluster import LINK_FAILURES
from homelab_gateway.line.refusals import Unavailable
from homelab_gateway.line.tokens import RedisTokens

if TYPE_CHECKING:
    from homelab_gateway.ledger import Ledger

log = Logger()
RUNNING_RETRY_AFTER = 5
"""Seconds a request refused for its client's running requests is told to wait: they end
soon, and may spend less than they reserved."""


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
        self._reads: list[list[tuple[str, int, float]]] = []  # spends while a seed reads

    def spend(self, client: str, tokens: int) -> None:
        now = self.clock.seconds()
        self.tally.add(client, tokens, now)
        for spent in self._reads:
            spent.append((client, tokens, now))

    def wait(self, client: str, limit: int) -> Deferred[float | None]:
        return succeed(self.tally.retry_after(client, limit, self.clock.seconds()))

    def known(self, client: str) -> int:
        return self.tally.used(client, self.clock.seconds())

    async def seed(self, ledger: Ledger, clients: Mapping[str, int]) -> None:
        """`clients`' days as the ledger has them, hour by hour, in place of what is counted
        here: at start, and after a reload (a client whose limit was lifted and restored was
        not counted meanwhile, and must not count twice). The ledger's read includes every
        request finished when it began; those that finish while it runs are counted after."""
        now = self.clock.seconds()
        spent: list[tuple[str, int, float]] = []
        self._reads.append(spent)
        try:
            rows = await ledger.rows(UsageQuery(since=now - quota.WINDOW, by=("client", "hour")))
        finally:
            self._reads.remove(spent)
        for client in clients:
            self.tally.forget(client)
        for row in rows:
            if row["client"] in clients:
                ended = datetime.fromisoformat(row["hour"]).timestamp() + HOUR
                tokens = row["input_tokens"] + row["output_tokens"]
                self.tally.add(row["client"], tokens, min(ended, now) - 1)
        for client, tokens, at in spent:
            if client in clients:
                self.tally.add(client, tokens, at)


class Shared:
    """The buckets in the cluster's Redis. Tokens that could not be sent are sent with the
    next spend or check, as spent then."""

    def __init__(self, buckets: RedisTokens) -> None:
        self.buckets = buckets
        self.unsent: dict[str, int] = {}
        self._known: dict[str, int] = {}  # each client's tokens at its last check, and since

    def spend(self, client: str, tokens: int) -> None:
        self._known[client] = self._known.get(client, 0) + tokens
        tokens += self.unsent.pop(client, 0)
        sent = self.buckets.tokens_call("spend", client, quota.WINDOW, tokens)
        sent.addErrback(self._unsent, client, tokens)

    def _unsent(self, failure: Any, client: str, tokens: int) -> None:
        self.unsent[client] = self.unsent.get(client, 0) + tokens

    def wait(self, client: str, limit: int) -> Deferred[float | None]:
        for name, tokens in list(self.unsent.items()):  # Redis may be back
            del self.unsent[name]
            self.buckets.tokens_call("spend", name, quota.WINDOW, tokens).addErrback(
                self._unsent, name, tokens
            )
        asked = self.buckets.tokens_call("spent", client, quota.WINDOW, limit)
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
    """The configured clients' `tokens_per_day`, their usage in `store`, and what their
    running requests may still spend (`running`: each one's reservation, its input estimate
    plus its output cap, from its slot to its end; this gateway's requests only)."""

    def __init__(self, limits: Mapping[str, int], store: Store) -> None:
        self.limits = dict(limits)
        self.store = store
        self.running: dict[str, dict[int, int]] = {}  # client -> id of record -> tokens

    def add(self, record: RequestRecord) -> None:
        """A finished request's tokens count against its client's quota where they are
        `charged`: it held a slot, and no error status answered it. Its reservation ends."""
        self._release(record)
        if record.client in self.limits and charged(record):
            tokens = (record.input_tokens or 0) + (record.output_tokens or 0)
            if tokens > 0:
                self.store.spend(record.client, tokens)

    async def check(self, record: RequestRecord) -> None:
        """Raise a 429 if the request's client has spent its quota in the rolling day, or
        would have once its other running requests spent their reservations. A store out of
        reach lets it by: the quota is a budget, not the cap."""
        client = record.client
        limit = self.limits.get(client)
        if limit is None:
            return
        try:
            wait = await self.store.wait(client, limit)
        except (Unavailable, *LINK_FAILURES) as e:
            log.warn("tokens_per_day of {client} not checked: {e}", client=client, e=e)
            return
        if wait is not None:
            seconds = max(1, int(-(-wait // 1)))
            raise _refusal(client, f"has used its {limit} tokens of the last 24 hours", seconds)
        others = sum(n for at, n in self.running.get(client, {}).items() if at != id(record))
        if others and (self.store.known(client) or 0) + others >= limit:
            spent = f"may spend its {limit} tokens of the last 24 hours in its running requests"
            raise _refusal(client, spent, RUNNING_RETRY_AFTER)

    async def admit(self, record: RequestRecord, output_cap: int | None) -> None:
        """A request just granted a slot: checked again, counting the reservations of its
        client's other running requests, so N requests let in at once on arrival overrun the
        day by at most N slots' worth; then it reserves its own until it ends (`add`)."""
        if record.client not in self.limits:
            return
        reserved = self.running.setdefault(record.client, {})
        reserved[id(record)] = (record.input_tokens or 0) + (output_cap or 0)
        try:
            await self.check(record)
        except Exception:
            self._release(record)
            raise

    def _release(self, record: RequestRecord) -> None:
        reserved = self.running.get(record.client)
        if reserved is not None and reserved.pop(id(record), None) is not None and not reserved:
            del self.running[record.client]

    def status(self) -> dict[str, dict[str, int | None]]:
        """Each limited client's quota and the tokens it used in the rolling day, as far as
        known here (in a cluster: at its last check here, and what this gateway counted since)."""
        return {
            client: {"tokens_per_day": limit, "tokens_used": self.store.known(client)}
            for client, limit in sorted(self.limits.items())
        }


def _refusal(client: str, why: str, seconds: int) -> GatewayError:
    return GatewayError(
        429,
        f"client {client} {why}; please try again in {seconds}s",
        retry_after=seconds,
        outcome="rejected_quota",
    )
