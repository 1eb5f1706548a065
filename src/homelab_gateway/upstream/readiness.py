"""Readiness: can every model be served? Probed in the background, so /readyz is instant.

Each upstream's health probe, as its kind says (`upstream.kinds`: vLLM's and llama.cpp's
`/health`, Ollama's `/`, any other server's model listing), is asked every `probe_interval`
seconds; none of them costs a sequence slot or loads a model. An upstream is ready while its latest
probe succeeded, that success is recent (a prober that stopped must not leave a stale "ready"
behind) and requests have not taken it out of rotation since. /readyz is 200 while every model
has a ready replica and every upstream no model names (a proxy route's) is ready. A probe that
succeeds also puts a replica that was out of rotation back at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred, ensureDeferred, gatherResults
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.replicas import DOWN
from homelab_gateway.upstream.client import Upstream
from homelab_gateway.upstream.kinds import Health, Kind

if TYPE_CHECKING:
    from homelab_gateway.line.pool import Pool

PROBE_BODY_LIMIT = 256 * 1024  # a model listing: Ollama lists every pulled model


@dataclass
class Probe:
    ok: bool = False
    at: float | None = None  # when the latest probe ended
    detail: str = "not probed yet"
    # Each model's window, where the kind's model listing says it; from the latest answer.
    windows: dict[str, int] = field(default_factory=dict)


class Readiness:
    def __init__(
        self,
        pools: Mapping[str, Pool],
        clock: IReactorTime,
        interval: float,
        models: Mapping[str, ModelConfig] = {},
    ) -> None:
        self.pools = pools
        self.models = models
        self.clock = clock
        self.interval = interval
        self.probes = {name: Probe() for name in pools}
        self._next: IDelayedCall | None = None
        self._round: Deferred[Any] | None = None
        self._stopped = False

    def start(self) -> None:
        self._stopped = False
        self._next = self.clock.callLater(0, self._probe_all)

    def stop(self) -> None:
        """Stop probing, cancelling a round in flight (its connections close with it)."""
        self._stopped = True
        if self._next is not None and self._next.active():
            self._next.cancel()
        self._next = None
        if self._round is not None:
            self._round.cancel()

    def _probe_all(self) -> None:
        self._next = None
        probes = [ensureDeferred(self._probe(n, p)) for n, p in self.pools.items()]
        self._round = gatherResults(probes, consumeErrors=True)
        self._round.addErrback(lambda _: None)  # only a cancelled round (stop) fails
        self._round.addCallback(self._round_done)

    def _round_done(self, _: object) -> None:
        self._round = None
        if not self._stopped:
            self._next = self.clock.callLater(self.interval, self._probe_all)

    async def _probe(self, name: str, pool: Pool) -> None:
        probe = self.probes[name]
        if pool.resident is not None and pool.resident.state != "loaded":
            return  # a model loaded on demand is not probed while it is not loaded
        health = await check(pool.upstream, pool.kind)
        listing = pool.kind.listing(pool.upstream.url) if health.ok else None
        if listing is not None:
            probe.windows = await _windows(pool.upstream, pool.kind, listing)
        # Told together with its windows: a ready upstream's window is known at once.
        probe.ok, probe.detail = health.ok, health.detail
        if health.ok:
            pool.line.recovered(pool.replica)
        probe.at = self.clock.seconds()

    def context_window(self, upstream: str, model: str) -> int | None:
        """The upstream's window for `model` as its model listing last said, if it says one."""
        probe = self.probes.get(upstream)
        return probe.windows.get(model) if probe is not None else None

    def report(self) -> tuple[bool, dict[str, Any]]:
        now = self.clock.seconds()
        upstreams: dict[str, Any] = {}
        for name, probe in self.probes.items():
            fresh = probe.at is not None and now - probe.at <= 2 * self.interval
            pool = self.pools.get(name)
            resident = pool.resident if pool is not None else None
            if resident is not None and (resident.state != "loaded" or not fresh):
                # Loaded on demand: ready to be loaded, unless its starts failed; just loaded
                # (its health answered the load), ready until the probe's next round says.
                state = resident.state
                upstreams[name] = {"ready": state != "failed", "detail": state}
                continue
            circuit = pool.replica.circuit if pool is not None else None
            ok = probe.ok and fresh and (circuit is None or circuit.state != DOWN)
            detail = probe.detail if fresh or probe.at is None else "no recent probe"
            if probe.ok and fresh and not ok:
                detail = f"out of rotation: {circuit.last_error if circuit else ''}"
            upstreams[name] = {"ready": ok, "detail": "ok" if ok else detail}
        ready = {name for name, u in upstreams.items() if u["ready"]}
        named = {name for model in self.models.values() for name in model.replicas}
        models_ok = all(ready.intersection(m.replicas) for m in self.models.values())
        return models_ok and all(n in ready for n in upstreams if n not in named), upstreams


async def check(upstream: Upstream, kind: Kind) -> Health:
    """One health probe of `upstream`, as its `kind` asks and reads it."""
    try:
        response = await upstream.open("GET", kind.probe(upstream.url), {}, None)
        body = await upstream.read_limited(response, PROBE_BODY_LIMIT)
    except GatewayError as e:
        return Health(False, e.message)
    return kind.health(response.code, body)


async def _windows(upstream: Upstream, kind: Kind, listing: str) -> dict[str, int]:
    """Each model's window from the model `listing`; none when it does not answer."""
    try:
        response = await upstream.open("GET", listing, {}, None)
        body = await upstream.read_limited(response, PROBE_BODY_LIMIT)
    except GatewayError:
        return {}
    return kind.windows(body) if response.code == 200 else {}
