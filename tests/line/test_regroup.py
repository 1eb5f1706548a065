"""Shared lines across reloads that regroup upstreams, on a real Redis: a line's key is always
the upstreams it serves, as at a fresh start, and a line the reload retired is dropped once
nothing runs or waits through it."""

from __future__ import annotations

import itertools
from typing import Any

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from homelab_gateway.config import parse_config
from homelab_gateway.line.limiter import Slot
from homelab_gateway.service import Gateway, shared_lines
from testsupport.helpers import wait_for
from testsupport.redis_server import RedisServer

_prefixes = itertools.count()
UPSTREAMS = ("u0", "u1", "u2", "u3")


def document(port: int, prefix: str, m: list[str]) -> dict[str, Any]:
    """Model m on the upstreams `m`; solo alone on u1; every upstream unreachable (none is
    asked anything here)."""
    return {
        "upstreams": {n: {"url": "http://127.0.0.1:9/v1", "slots": 1} for n in UPSTREAMS},
        "models": {"m": {"upstreams": m}, "solo": {"upstream": "u1"}},
        "cluster": {"redis_url": f"redis://127.0.0.1:{port}/0", "lease": 1.5, "prefix": prefix},
        "usage": {"database": ":memory:"},
    }


class Regrouped(TestCase):
    async def gateway(self, m: list[str]) -> Gateway:
        gateway = Gateway(parse_config(self.document(m), environ={}), reactor)
        assert gateway.cluster is not None
        gateway.cluster.start()
        self.addCleanup(gateway.close)
        await wait_for(lambda: gateway.cluster.live, what="linked")  # type: ignore[union-attr]
        return gateway

    def document(self, m: list[str]) -> dict[str, Any]:
        return document(self.redis.port, self.prefix, m)

    def setUp(self) -> None:
        self.redis = RedisServer()
        self.redis.start()
        self.addCleanup(self.redis.close)
        self.prefix = f"rg{next(_prefixes)}:"

    def keys(self, gateway: Gateway) -> set[str]:
        assert gateway.cluster is not None
        return set(gateway.cluster.lines)

    def configured(self, m: list[str]) -> set[str]:
        config = parse_config(self.document(m), environ={})
        return {"+".join(sorted(names)) for names in shared_lines(config)}

    async def test_a_reloaded_line_has_the_key_a_fresh_start_gives_it(self) -> None:
        """m moves from [u0] to [u0, u1] to [u0, u2], solo stays on u1: solo's line is "u1" on
        the reloaded gateway as on one started with that config, so both share u1's line."""
        reloaded = await self.gateway(["u0"])
        for m in (["u0", "u1"], ["u0", "u2"]):
            reloaded.reload(parse_config(self.document(m), environ={}))
        fresh = await self.gateway(["u0", "u2"])
        for gateway in (reloaded, fresh):
            line = gateway.pools["u1"].replica.line
            self.assertEqual(line.source.key, "u1")
            self.assertEqual({m.name for m in line.members}, {"u1"})
        await wait_for(lambda: self.keys(reloaded) == self.keys(fresh), what="the same lines")
        self.assertEqual(self.keys(fresh), {"u0+u2", "u1", "u3"})

    async def test_retired_lines_are_dropped_once_nothing_runs_or_waits_through_them(
        self,
    ) -> None:
        gateway = await self.gateway(["u0"])
        for m in (["u0", "u1"], ["u0", "u2"], ["u1", "u3"], ["u0"], ["u2", "u3"]):
            gateway.reload(parse_config(self.document(m), environ={}))
        await wait_for(lambda: self.keys(gateway) == self.configured(["u2", "u3"]))

        # A retired line that a request still holds a slot through stays until it ends.
        running = gateway.pools["u1"].replica.line.acquire_in_line(client="c")
        await wait_for(lambda: running.called, what="a slot of u1")
        slot = running.result
        assert isinstance(slot, Slot)
        gateway.reload(parse_config(self.document(["u0", "u1"]), environ={}))
        await wait_for(lambda: "u0+u1" in self.keys(gateway), what="the new line")
        self.assertIn(slot.semaphore.source, gateway.cluster.lines.values())  # type: ignore[union-attr]
        slot.release()
        await wait_for(lambda: self.keys(gateway) == self.configured(["u0", "u1"]))

    async def test_a_line_of_the_same_key_as_a_retired_one_keeps_its_running_slot(
        self,
    ) -> None:
        """u1's line is retired while a request holds its slot, then a reload makes a new
        line "u1": that line's copy counts the slot as running, not as a leftover to give
        back, and the retired line goes when the request ends."""
        gateway = await self.gateway(["u0"])
        running = gateway.pools["u1"].replica.line.acquire_in_line(client="c")
        await wait_for(lambda: running.called, what="a slot of u1")
        slot = running.result
        assert isinstance(slot, Slot) and gateway.cluster is not None
        for m in (["u0", "u1"], ["u0"]):
            gateway.reload(parse_config(self.document(m), environ={}))
        line = gateway.pools["u1"].replica.line
        self.assertIsNot(line, slot.semaphore)
        await wait_for(lambda: not gateway.cluster._awaiting, what="the new lines read")  # type: ignore[union-attr]
        slots = await gateway.cluster._commands.hgetall(f"{self.prefix}upstream:u1:slots")
        self.assertEqual(list(slots), [slot.id], "the running request's slot was given back")
        self.assertEqual(gateway.pools["u1"].replica.held, 1)
        slot.release()
        await wait_for(lambda: gateway.pools["u1"].replica.held == 0, what="the slot free")
        await wait_for(lambda: set(gateway.cluster._calls) == set(gateway.cluster.lines.values()))  # type: ignore[union-attr]
        self.assertEqual(self.keys(gateway), self.configured(["u0"]))
