"""The usage ledger on a real SQLite file: batched writes on a `Clock`, queries that see every
finished request, restarts that keep the sums, retention."""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from homelab_gateway.config import UsageConfig
from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.usage import UsageQuery
from homelab_gateway.ledger import DAY, Ledger
from tests.test_twistd import run_gateway

NOON = 1_796_212_800  # 2026-12-02T12:00:00Z


def record(**fields: Any) -> RequestRecord:
    defaults: dict[str, Any] = {
        "served_model": "reasoning",
        "client": "alice",
        "input_tokens": 100,
        "output_tokens": 20,
        "cached_tokens": 64,
        "slot_seconds": 1.5,
        "queue_wait": 0.5,
    }
    return RequestRecord(
        request_id="req_1", surface="messages", started=0.0, **{**defaults, **fields}
    )


class LedgerTest(TestCase):
    def setUp(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="hg-ledger-"))
        self.addCleanup(shutil.rmtree, self.path)
        self.database = str(self.path / "usage.sqlite3")
        self.clock = Clock()
        self.clock.advance(NOON + 60)

    def ledger(self, keep_days: int = 90) -> Ledger:
        ledger = Ledger(self.database, keep_days, self.clock)
        self.addCleanup(ledger.stop)
        return ledger

    async def written(self, ledger: Ledger) -> list[tuple[Any, ...]]:
        """The table's rows, read on the ledger's one thread: after every write asked before."""
        rows: list[tuple[Any, ...]] = await ledger._pool().runQuery(
            "SELECT client, model, surface, hour, outcome, requests, input_tokens FROM usage"
        )
        return rows

    async def test_requests_are_written_together_once_a_second(self) -> None:
        ledger = self.ledger()
        ledger.start()
        ledger.add(record())
        ledger.add(record(outcome="client_gone"))
        ledger.add(record())
        self.assertEqual(await self.written(ledger), [])
        self.clock.advance(1)
        self.assertEqual(ledger.pending, {})
        self.assertEqual(
            sorted(await self.written(ledger)),
            [
                ("alice", "reasoning", "messages", NOON, "client_gone", 1, 100),
                ("alice", "reasoning", "messages", NOON, "completed", 2, 200),
            ],
        )

    async def test_a_query_sees_the_request_that_just_finished(self) -> None:
        ledger = self.ledger()
        ledger.add(record())
        ledger.add(record(client="bob", input_tokens=7, output_tokens=3, cached_tokens=0))
        rows = await ledger.rows(UsageQuery(by=("client", "hour")))
        self.assertEqual(
            rows,
            [
                {
                    "client": "alice",
                    "hour": "2026-12-02T12:00:00Z",
                    "requests": 1,
                    "input_tokens": 100,
                    "output_tokens": 20,
                    "cached_tokens": 64,
                    "slot_seconds": 1.5,
                    "wait_seconds": 0.5,
                },
                {
                    "client": "bob",
                    "hour": "2026-12-02T12:00:00Z",
                    "requests": 1,
                    "input_tokens": 7,
                    "output_tokens": 3,
                    "cached_tokens": 0,
                    "slot_seconds": 1.5,
                    "wait_seconds": 0.5,
                },
            ],
        )
        alone = await ledger.rows(UsageQuery(client="bob", since=NOON + 3600, by=("model",)))
        self.assertEqual(alone, [])

    async def test_tokens_by_hour_sum_every_model_and_outcome_from_the_first_hour_on(self) -> None:
        ledger = self.ledger()
        ledger.add(record())
        self.clock.advance(3600)
        ledger.add(record(served_model="qwen-coder"))
        ledger.add(record(outcome="client_disconnected", output_tokens=5))
        ledger.add(record(client="bob", input_tokens=7, output_tokens=3))
        self.assertEqual(
            sorted(await ledger.tokens_by_hour(NOON)),
            [("alice", NOON, 100, 20), ("alice", NOON + 3600, 200, 25), ("bob", NOON + 3600, 7, 3)],
        )
        self.assertEqual(
            sorted(await ledger.tokens_by_hour(NOON + 3600)),
            [("alice", NOON + 3600, 200, 25), ("bob", NOON + 3600, 7, 3)],
        )

    async def test_the_sums_survive_a_restart_and_keep_adding_up(self) -> None:
        first = self.ledger()
        first.add(record())
        await first.stop()
        again = self.ledger()
        again.add(record(input_tokens=1))
        self.clock.advance(3600)  # another hour, another row
        again.add(record(input_tokens=1))
        rows = await again.rows(UsageQuery(by=("hour",)))
        self.assertEqual([(r["requests"], r["input_tokens"]) for r in rows], [(2, 101), (1, 1)])

    async def test_hours_older_than_keep_days_go_at_start(self) -> None:
        first = self.ledger(keep_days=2)
        first.add(record())
        self.clock.advance(DAY)
        first.add(record(client="recent"))
        await first.stop()
        self.clock.advance(DAY + 3600)
        again = self.ledger(keep_days=2)
        again.start()
        rows = await again.rows(UsageQuery())
        self.assertEqual([row["client"] for row in rows], ["recent"])

    async def test_a_write_that_fails_keeps_its_buckets_for_the_next(self) -> None:
        ledger = Ledger(str(self.path / "missing" / "usage.sqlite3"), 90, self.clock)
        self.addCleanup(ledger.stop)
        ledger.add(record())
        await ledger.flush()
        ledger.add(record())
        await ledger.flush()
        self.assertEqual(len(self.flushLoggedErrors(sqlite3.OperationalError)), 1, "said once")
        self.assertEqual(sum(sums[0] for sums in ledger.pending.values()), 2)
        (self.path / "missing").mkdir()
        await ledger.stop()
        with sqlite3.connect(self.path / "missing" / "usage.sqlite3") as connection:
            self.assertEqual(connection.execute("SELECT requests FROM usage").fetchall(), [(2,)])


def test_a_database_it_cannot_write_stops_the_start_with_one_line(tmp_path: Path) -> None:
    """As under systemd's `ProtectSystem=strict` with no state directory: `/proc` takes no
    file, even from root."""
    (tmp_path / "gw.toml").write_text('[usage]\ndatabase = "/proc/usage.sqlite3"\n')
    result = run_gateway(tmp_path, "--config", str(tmp_path / "gw.toml"))
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output, output
    lines = [line for line in output.splitlines() if "usage.database" in line]
    assert len(lines) == 1, output
    assert "usage.database: cannot write /proc/usage.sqlite3" in lines[0]


def test_the_systemd_unit_keeps_the_default_ledger_in_its_state_directory() -> None:
    """`ProtectSystem=strict` makes `/` read-only: the unit's working directory, where the
    default `usage.sqlite3` lands, is its `StateDirectory=`."""
    unit = Path(__file__).parent.parent / "etc" / "homelab-gateway.service"
    lines = unit.read_text().splitlines()
    settings = dict(line.split("=", 1) for line in lines if "=" in line and line[0] != "#")
    assert settings["ProtectSystem"] == "strict"
    assert settings["WorkingDirectory"] == f"%S/{settings['StateDirectory']}"
    assert UsageConfig().database == "usage.sqlite3"  # relative: in the working directory


def test_the_check_at_start_leaves_no_file_it_made(tmp_path: Path) -> None:
    Ledger(str(tmp_path / "usage.sqlite3"), 90, Clock()).check()
    assert list(tmp_path.iterdir()) == []
