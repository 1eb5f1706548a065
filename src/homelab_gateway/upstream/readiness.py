"""Readiness: can every model be served? Probed in the background, so /readyz is instant.

Each upstream's `GET {url}/models` is asked every `probe_interval` seconds (vLLM, Ollama and
llama.cpp all serve it, and it costs no sequence slot). An upstream is ready while its latest
probe succeeded, that success is recent (a prober that stopped must not leave a stale "ready"
behind) and requests have not taken it out of rotation since. /readyz is 200 while every model
has a ready replica and every upstream no model names (a proxy route's) is ready. A probe that
succeeds also puts a replica that was out of rotation back at once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twisted.internet.defer import Deferred, ensureDeferred, gatherResults
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.errors import GatewayError
from homelab_gateway.core.replicas import DOWN

if TYPE_CHECKING:
    from homelab_gateway.line.pool import Pool

MODELS_BODY_LIMIT = 256 * 1024  # Ollama lists every pulled model


@dataclass
class Probe:
    ok: bool = False
    at: float | None = None  # when the latest probe ended
    detail: str = "not probed yet"
    # vLLM's /v1/models says each model's window (max_model_len); kept from the latest answer.
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
        upstream = pool.upstream
        probe = self.probes[name]
        try:
            response = await upstream.open("GET", upstream.url + "/models", {}, None)
            body = await upstream.read_limited(response, MODELS_BODY_LIMIT)
        except GatewayError as e:
            probe.ok, probe.detail = False, e.message
        else:
            probe.ok = response.code == 200
            probe.detail = "ok" if probe.ok else f"GET /models answered {response.code}"
            if probe.ok:
                probe.windows = _windows(body)
                pool.line.recovered(pool.replica)
        probe.at = self.clock.seconds()

    def context_window(self, upstream: str, model: str) -> int | None:
        """The upstream's window for `model` as its /models last said, if it says one."""
        probe = self.probes.get(upstream)
        return probe.windows.get(model) if probe is not None else None

    def report(self) -> tuple[bool, dict[str, Any]]:
        now = self.clock.seconds()
        upstreams: dict[str, Any] = {}
        for name, probe in self.probes.items():
            fresh = probe.at is not None and now - probe.at <= 2 * self.interval
            pool = self.pools.get(name)
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


def _windows(body: bytes) -> dict[str, int]:
    """{model id: max_model_len} from an OpenAI /models list; vLLM is the one that says it."""
    try:
        data = json.loads(body).get("data")
    except (ValueError, AttributeError):
        return {}
    windows: dict[str, int] = {}
    for entry in data if isinstance(data, list) else ():
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            size = entry.get("max_model_len")
            if isinstance(size, int) and not isinstance(size, bool) and size > 0:
                windows[entry["id"]] = size
    return windows
