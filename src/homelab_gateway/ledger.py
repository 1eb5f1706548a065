"""The usage ledger: `core.usage`'s hourly buckets in SQLite, so who used what survives restarts.

A finished request only folds into buckets in memory (`add`, on the reactor's thread, no I/O).
Once a second the pending buckets go to the database in one transaction of upserts, on the
connection pool's one thread: no request ever waits for SQLite, and a process killed outright
loses at most that second. A query first writes what is pending, so it sees every request that
has finished. Rows older than `keep_days` are deleted at start and then every hour.
"""

from __future__ import annotations

import os
import sqlite3
from typing import Any

from twisted.enterprise import adbapi
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.usage import SUMS, Buckets, Key, UsageQuery, add, fold, group

log = Logger()
FLUSH_INTERVAL = 1.0  # seconds of finished requests a crash may lose
TRIM_INTERVAL = 3600.0
DAY = 86400
MEMORY = ":memory:"  # SQLite's name for a database that lives only as long as its connection

KEY = ("hour", "client", "model", "surface", "outcome")  # hour first: ranges and trims use it
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS usage (
    hour INTEGER NOT NULL,
    client TEXT NOT NULL,
    model TEXT NOT NULL,
    surface TEXT NOT NULL,
    outcome TEXT NOT NULL,
    requests INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    slot_seconds REAL NOT NULL,
    wait_seconds REAL NOT NULL,
    PRIMARY KEY ({", ".join(KEY)})
) WITHOUT ROWID
"""
UPSERT = (
    f"INSERT INTO usage ({', '.join(KEY + SUMS)}) VALUES ({', '.join('?' * len(KEY + SUMS))})"
    f" ON CONFLICT ({', '.join(KEY)}) DO UPDATE SET "
    + ", ".join(f"{name} = {name} + excluded.{name}" for name in SUMS)
)


def _prepare(connection: sqlite3.Connection) -> None:
    """Each new connection, on the pool's thread: WAL (a reader never blocks the writer; a
    commit is one append) with `synchronous = NORMAL`, which keeps every commit through a
    crash of the process and risks only the last ones to a power cut; and the table."""
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute("PRAGMA synchronous = NORMAL")
    connection.execute(SCHEMA)


def _write(cursor: Any, buckets: Buckets) -> None:
    rows = [
        (hour, client, model, surface, outcome, *sums)
        for (client, model, surface, hour, outcome), sums in buckets.items()
    ]
    cursor.executemany(UPSERT, rows)


def _read(cursor: Any, query: UsageQuery) -> list[dict[str, Any]]:
    """The query's rows, grouped here on the pool's thread rather than the reactor's."""
    first, past = query.hours()
    where, values = [], []
    bounds = (("hour >= ?", first), ("hour < ?", past), ("client = ?", query.client))
    for condition, value in bounds:
        if value is not None:
            where.append(condition)
            values.append(value)
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    cursor.execute(f"SELECT {', '.join(KEY + SUMS)} FROM usage{clause}", values)
    buckets: Buckets = {}
    for hour, client, model, surface, outcome, *sums in cursor.fetchall():
        key: Key = (client, model, surface, hour, outcome)
        add(buckets, key, sums)
    return group(buckets, query.by)


def _tokens_by_hour(cursor: Any, first: int) -> list[tuple[str, int, int, int]]:
    cursor.execute(
        "SELECT client, hour, SUM(input_tokens), SUM(output_tokens) FROM usage"
        " WHERE hour >= ? GROUP BY client, hour",
        (first,),
    )
    rows: list[tuple[str, int, int, int]] = cursor.fetchall()
    return rows


class LedgerError(Exception):
    """The database cannot be written: one line, for the start to end with."""


class Ledger:
    """The usage of every finished request on the LLM surfaces, by client, model, surface,
    hour and outcome. `start` begins the timed writes and trims; `stop` writes what is
    pending and closes the database."""

    def __init__(
        self, database: str, keep_days: int, clock: IReactorTime, *, reactor: Any = None
    ) -> None:
        self.database = database if database == MEMORY else os.path.abspath(database)
        self.keep_days = keep_days
        self.clock = clock
        self.pending: Buckets = {}
        self._closed = False
        self._failing = False  # the last write failed (and said so)
        self._reactor = reactor
        self._connections: adbapi.ConnectionPool | None = None
        self._flushing = LoopingCall(self.flush)
        self._flushing.clock = clock
        self._trimming = LoopingCall(self.trim)
        self._trimming.clock = clock

    def _pool(self) -> adbapi.ConnectionPool:
        """The database's one connection on one thread, made when first needed (a gateway that
        never counts a request starts no thread): SQLite has one writer anyway, and the one
        thread keeps every write and read in the order asked (a query after the writes it
        must see)."""
        if self._connections is None:
            self._connections = adbapi.ConnectionPool(
                "sqlite3",
                self.database,
                check_same_thread=False,
                cp_min=1,
                cp_max=1,
                cp_openfun=_prepare,
                cp_reactor=self._reactor,
            )
        return self._connections

    def check(self) -> None:
        """Open the database and write to it (a row, rolled back) here and now, before the
        gateway listens: one it cannot write (a read-only folder, as `/` is under systemd's
        `ProtectSystem=strict`) is a `LedgerError` at start rather than a traceback at every
        write while requests go uncounted. A file made for the check is removed again: the
        first write makes it anew, and a gateway that never counts a request leaves none."""
        if self.database == MEMORY:
            return
        existed = os.path.exists(self.database)
        try:
            connection = sqlite3.connect(self.database)
            try:
                _prepare(connection)
                connection.execute("BEGIN IMMEDIATE")
                connection.execute(UPSERT, (0, "", "", "", "", *[0] * len(SUMS)))
                connection.rollback()
            finally:
                connection.close()
        except sqlite3.Error as e:
            raise LedgerError(f"cannot write {self.database}: {e}") from None
        if not existed:
            os.remove(self.database)

    def start(self) -> None:
        self._trimming.start(TRIM_INTERVAL, now=True)
        self._flushing.start(FLUSH_INTERVAL, now=False)

    def add(self, record: RequestRecord) -> None:
        fold(self.pending, record, self.clock.seconds())

    def flush(self) -> Deferred[None]:
        """Write the pending buckets in one transaction. A write that fails is logged and its
        buckets are kept for the next one; the Deferred never fails (a LoopingCall stops at
        the first failure)."""
        if not self.pending:
            return succeed(None)
        pending, self.pending = self.pending, {}
        written: Deferred[None] = self._pool().runInteraction(_write, pending)
        return written.addCallbacks(self._written, self._unwritten, errbackArgs=(pending,))

    def _written(self, _: None) -> None:
        if self._failing:
            self._failing = False
            log.info("usage ledger: writing to {database} again", database=self.database)

    def _unwritten(self, failure: Failure, pending: Buckets) -> None:
        """Keep the buckets for the next write; say so once, not once a second."""
        if not self._failing:
            self._failing = True
            log.failure(
                "usage ledger: cannot write to {database}; its buckets are kept to try again",
                failure,
                database=self.database,
            )
        for key, sums in pending.items():
            add(self.pending, key, sums)

    def trim(self) -> Deferred[None]:
        """Delete the hours that began more than `keep_days` ago."""
        cutoff = self.clock.seconds() - self.keep_days * DAY
        trimmed: Deferred[None] = self._pool().runOperation(
            "DELETE FROM usage WHERE hour < ?", (cutoff,)
        )
        return trimmed.addErrback(
            lambda failure: log.failure(
                "usage ledger: cannot trim {database}", failure, database=self.database
            )
        )

    async def rows(self, query: UsageQuery) -> list[dict[str, Any]]:
        """`/llm/v1/usage`'s rows, every finished request included."""
        await self.flush()
        rows: list[dict[str, Any]] = await self._pool().runInteraction(_read, query)
        return rows

    async def tokens_by_hour(self, first: int) -> list[tuple[str, int, int, int]]:
        """(client, hour, input tokens, output tokens) for the hours from `first` on, every
        finished request included: the status page's tokens per client per day."""
        await self.flush()
        rows: list[tuple[str, int, int, int]] = await self._pool().runInteraction(
            _tokens_by_hour, first
        )
        return rows

    async def stop(self) -> None:
        """Write what is pending and close the database; once, however often it is called."""
        if self._closed:
            return
        self._closed = True
        for call in (self._flushing, self._trimming):
            if call.running:
                call.stop()
        # A database in memory that was never opened has nobody to keep its rows for.
        if self.database != MEMORY or self._connections is not None:
            await self.flush()
        if self._connections is not None:
            self._connections.close()
