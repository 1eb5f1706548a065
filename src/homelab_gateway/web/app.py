"""The gateway's URL space as Klein routes: health and metrics, the /llm surface, proxy routes.

Handlers only choose what runs. `_work` is the one door for requests that reach an upstream
(access checks, a RequestRecord, InFlight); `_light` guards the informational endpoints.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from klein import Klein
from klein.interfaces import IKleinRequest
from prometheus_client.twisted import MetricsResource
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from werkzeug.exceptions import HTTPException, NotFound

from homelab_gateway.config import ModelConfig
from homelab_gateway.core.errors import GatewayError, internal_error
from homelab_gateway.core.mapping import find_model
from homelab_gateway.core.record import RequestRecord
from homelab_gateway.core.surfaces import SURFACES, SurfaceRow
from homelab_gateway.core.usage import InvalidQuery, parse_query, render_csv
from homelab_gateway.ledger import Ledger
from homelab_gateway.line.cluster import Cluster
from homelab_gateway.line.pool import Pool
from homelab_gateway.line.residency import boxes_status
from homelab_gateway.quotas import Quotas
from homelab_gateway.surfaces.proxy import ReverseProxy
from homelab_gateway.surfaces.skeleton import Surface, SurfaceSettings
from homelab_gateway.telemetry import Telemetry
from homelab_gateway.upstream.readiness import Readiness
from homelab_gateway.web.access import AccessPolicy
from homelab_gateway.web.inflight import InFlight
from homelab_gateway.web.respond import Shape, send_error, send_json, shape_of
from homelab_gateway.web.statuspage import PAGE, PAGE_FILES, StatusPage, send_asset

log = Logger()
MODEL_CREATED_AT = "2025-01-01T00:00:00Z"


def _iso(at: float | None, now: float) -> str | None:
    """A moment on the gateway's clock as UTC ISO 8601 (status readers compare wall time)."""
    if at is None:
        return None
    wall = datetime.now(UTC).timestamp() + (at - now)
    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="seconds")


Work = Callable[[RequestRecord], Coroutine[Any, Any, Any]]


def surfaces_of(settings: SurfaceSettings) -> dict[str, Surface]:
    """Each surface of the table, by name, answering with `settings`."""
    surfaces = {}
    for row in SURFACES:
        module, _, name = row.surface.partition(":")
        kind = getattr(importlib.import_module(f"homelab_gateway.surfaces.{module}"), name)
        surfaces[row.name] = kind(settings, row)
    return surfaces


def _surface_route(row: SurfaceRow) -> Callable[[GatewayApp, IRequest], Any]:
    def route(self: GatewayApp, request: IRequest) -> Any:
        return self.surface(request, row)

    route.__name__ = f"surface_{row.name}"
    return route


class GatewayApp:
    app = Klein()

    def __init__(
        self,
        *,
        models: Mapping[str, ModelConfig],
        pools: Mapping[str, Pool],
        proxy: ReverseProxy,
        settings: SurfaceSettings,
        access: AccessPolicy,
        inflight: InFlight,
        telemetry: Telemetry,
        readiness: Readiness,
        ledger: Ledger,
        quotas: Quotas,
        cluster: Cluster | None = None,
    ) -> None:
        self.models = models
        self.pools = pools
        self.proxy = proxy
        self.use(settings)
        self.access = access
        self.inflight = inflight
        self.cluster = cluster
        self.telemetry = telemetry
        self.readiness = readiness
        self.ledger = ledger
        self.quotas = quotas
        self.metrics_resource = MetricsResource(telemetry.registry)
        self.status_page = StatusPage(
            settings.clock,
            telemetry,
            pools,
            self.status_document,
            tokens_by_hour=ledger.tokens_by_hour,
        )

    def use(self, settings: SurfaceSettings) -> None:
        """Answer new requests with `settings` (at start, and at each reload); a request
        already running keeps the surface it started with."""
        self.settings = settings
        self.surfaces = surfaces_of(settings)

    def _work(
        self, request: IRequest, surface: str, work: Work, *, shape: Shape, respond: bool = False
    ) -> Any:
        request_id = request.request_id  # GatewayRequest gives every answer one
        self.access.add_cors_headers(request)
        if self.access.cors_origins and self.access.is_preflight(request):
            return self.access.preflight(request)
        record = self.telemetry.start(request_id, surface, request.method, request.path)
        refusal = self.access.refusal(request, protected=True, draining=self.inflight.draining)
        if refusal is not None:
            record.outcome, record.status = refusal.outcome, refusal.status
            self.telemetry.finish(record)
            return send_error(request, refusal, shape=shape)
        caller = self.access.caller(request)
        record.client, record.priority = caller.client, caller.priority
        return self.inflight.run(request, record, work(record), shape=shape, respond=respond)

    def _light(
        self, request: IRequest, *, protected: bool, shape: Shape = "anthropic"
    ) -> bytes | None:
        """CORS and, where `protected`, the API key for a read-only endpoint; an answer if the
        request stops here."""
        self.access.add_cors_headers(request)
        if self.access.is_preflight(request):
            return self.access.preflight(request)
        refusal = self.access.refusal(request, protected=protected, draining=False)
        return None if refusal is None else send_error(request, refusal, shape=shape)

    @app.route("/healthz", methods=["GET", "HEAD"])
    def healthz(self, request: IRequest) -> bytes:
        return send_json(request, 200, {"status": "ok"})

    @app.route("/readyz", methods=["GET", "HEAD"])
    def readyz(self, request: IRequest) -> bytes:
        ready, upstreams = self.readiness.report()
        if self.cluster is not None and not self.cluster.live:
            ready = False  # every request would get 529: send them to another gateway
        if self.inflight.draining:
            return send_json(request, 503, {"status": "shutting down", "upstreams": upstreams})
        return send_json(
            request,
            200 if ready else 503,
            {"status": "ready" if ready else "not ready", "upstreams": upstreams},
        )

    @app.route("/metrics", methods=["GET", "OPTIONS"])
    def metrics(self, request: IRequest) -> Any:
        return self._light(request, protected=self.access.protect_metrics) or self.metrics_resource

    def surface(self, request: IRequest, row: SurfaceRow) -> Any:
        """A request on one of the table's surfaces. Its flight writes the answer and finishes
        the request (`respond`); Klein gets `ANSWERED_BY_ITS_FLIGHT`, so its render chain ends
        here rather than hold, for a stream's whole wait in the line, its closures and the
        callbacks on the handler's Deferred (see `AnsweredByItsFlight`). An answer given at
        once (a refusal, a preflight) is Klein's to write, as any route's."""
        surface = self.surfaces[row.name]
        answer = self._work(
            request, row.name, lambda r: surface.answer(request, r), shape=row.shape, respond=True
        )
        return ANSWERED_BY_ITS_FLIGHT if isinstance(answer, Deferred) else answer

    for _row in SURFACES:
        for _path in _row.paths:
            app.route(_path.decode(), endpoint=f"{_row.name} {_path.decode()}")(
                _surface_route(_row)
            )
    del _row, _path

    @app.route("/llm/v1/responses/<path:rest>")
    def stored_response(self, request: IRequest, rest: str) -> Any:
        """A stored response, its input items, its cancel: nothing is stored here."""
        refusal = self._light(request, protected=True, shape="openai")
        if refusal is not None:
            return refusal
        error = GatewayError(
            404,
            "not served here: this gateway stores no responses, and answers only POST "
            "/llm/v1/responses, each answer once",
            code="not_found",
        )
        return send_error(request, error, shape="openai")

    @app.route("/llm/v1/models", methods=["GET", "OPTIONS"])
    def list_models(self, request: IRequest) -> bytes:
        stop = self._light(request, protected=True)
        if stop is not None:
            return stop
        data = [
            self._model_entry(name, model)
            for name, model in self.models.items()
            if "*" not in name  # a pattern is no model's id; GET one of its names instead
        ]
        return send_json(
            request,
            200,
            {
                "object": "list",
                "data": data,
                "has_more": False,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
            },
        )

    @app.route("/llm/v1/models/<path:name>", methods=["GET", "OPTIONS"])
    def get_model(self, request: IRequest, name: str) -> bytes:
        stop = self._light(request, protected=True)
        if stop is not None:
            return stop
        model = find_model(self.models, name)
        if model is None:
            return send_error(request, GatewayError(404, f"model: {name!r} is not served here"))
        return send_json(request, 200, self._model_entry(name, model))

    def _model_entry(self, name: str, model: ModelConfig) -> dict[str, Any]:
        """Anthropic's Models API entry (with OpenAI's fields beside it, for OpenAI clients).

        `max_input_tokens` is the model's window and `max_tokens` its output cap (the window
        where none is configured); both are null where neither the upstream nor the config says.
        """
        created = datetime.fromisoformat(MODEL_CREATED_AT)
        window = self.settings.context_window(model)
        return {
            "id": name,
            "type": "model",
            "display_name": name,
            "created_at": MODEL_CREATED_AT,
            "max_input_tokens": window,
            "max_tokens": model.max_tokens or window,
            "object": "model",
            "created": int(created.replace(tzinfo=UTC).timestamp()),
            "owned_by": "homelab-gateway",
        }

    @app.route("/llm/v1/status", methods=["GET", "OPTIONS"])
    def status(self, request: IRequest) -> bytes:
        stop = self._light(request, protected=self.access.protect_metrics)
        if stop is not None:
            return stop
        return send_json(request, 200, self.status_document())

    @app.route("/llm/v1/usage", methods=["GET", "OPTIONS"])
    async def usage(self, request: IRequest) -> bytes:
        """Who used what (`ledger.Ledger`), grouped as asked, as JSON or CSV. Wherever keys
        exist it takes one: a `[clients]` key reads its own client's rows only, an operator's
        key every client's."""
        stop = self._light(request, protected=True)
        if stop is not None:
            return stop
        try:
            query = parse_query(request.args)
        except InvalidQuery as e:
            return send_error(request, GatewayError(400, str(e), param=e.param))
        own = self.access.client_key(request)
        if own is not None and query.client not in (None, own):
            message = f"client: the key of client {own} reads only its own usage"
            return send_error(request, GatewayError(403, message, param="client"))
        if own is not None:
            query = replace(query, client=own)
        rows = await self.ledger.rows(query)
        if query.format == "csv":
            request.setResponseCode(200)
            request.setHeader(b"content-type", b"text/csv; charset=utf-8")
            return render_csv(rows, query.by)
        return send_json(request, 200, {"rows": rows})

    def status_document(self) -> dict[str, Any]:
        """What `/llm/v1/status` says; the status page shows the same, with more."""
        now = self.settings.clock.seconds()
        models: dict[str, list[str]] = {}
        for model in self.models.values():
            for name in model.replicas:
                models.setdefault(name, []).append(model.name)
        upstreams = {}
        for name, pool in self.pools.items():
            line, circuit = pool.line, pool.replica.circuit
            at = line.clock.seconds()  # the line's times are on its clock (Redis's, if shared)
            upstreams[name] = {
                "slots": pool.replica.limit,
                "in_use": pool.replica.held,
                "health": circuit.state,
                "down_since": _iso(circuit.down_since, at),
                "retry_at": _iso(circuit.retry_at, at),
                "last_error": circuit.last_error,
                "fallback": pool.replica.fallback,
                "models": models.get(name, []),
                "line": line.name,
                "waiting": len(line.waiting),
                "waiting_by_class": line.line.waiting_by_class(at),
                "waiting_by_client": line.line.waiting_by_client(),
            }
            if pool.resident is not None:  # loaded on demand
                upstreams[name]["state"] = pool.resident.state
        lines = {}
        for model in self.models.values():
            line = self.pools[model.replicas[0]].line
            lines[model.name] = {
                "upstreams": list(model.replicas),
                "line": line.name,
                "waiting": len(line.waiting),
            }
        surfaces = Counter(record.surface for record in self.telemetry.active.values())
        document: dict[str, Any] = {
            "upstreams": upstreams,
            "models": lines,
            # Every request being handled (waiting or answered), by the surface it came in on.
            "surfaces": {name: {"in_flight": n} for name, n in sorted(surfaces.items())},
        }
        clients = self._limited_clients()
        if clients:
            document["clients"] = clients
        boxes = boxes_status(self.pools)
        if boxes:
            document["boxes"] = boxes
        if self.cluster is not None:
            document["cluster"] = {
                "instance": self.cluster.instance,
                "redis": "up" if self.cluster.live else "down",
                "down_since": _iso(self.cluster.lost_at, now),
                "last_error": self.cluster.last_error,
            }
        return document

    def _limited_clients(self) -> dict[str, dict[str, Any]]:
        """The clients with a max_in_flight (the slots each line holds for them) or a
        tokens_per_day (the tokens of theirs in the rolling day)."""
        clients: dict[str, dict[str, Any]] = {}
        for line in dict.fromkeys(pool.line for pool in self.pools.values()):
            dispatch = line.dispatch
            for client, cap in dispatch.caps.items():
                entry = clients.setdefault(client, {"max_in_flight": cap, "in_flight": {}})
                entry["in_flight"][line.name] = dispatch.in_flight.get(client, 0)
        for client, entry in self.quotas.status().items():
            clients.setdefault(client, {}).update(entry)
        return dict(sorted(clients.items()))

    @app.route("/status", methods=["GET", "HEAD"])
    def status_page_html(self, request: IRequest) -> bytes:
        return send_asset(request, PAGE)

    @app.route("/status/events", methods=["GET", "OPTIONS"])
    def status_events(self, request: IRequest) -> Any:
        """The page's event stream: it needs a key where `/llm/v1/status` does, sent as a
        header (the page reads the stream with fetch, not EventSource, which cannot send one:
        a key in the URL would be written to proxies' logs and the browser's history).
        Past `[server] max_status_subscribers` open streams, `subscribe` answers 503 itself."""
        stop = self._light(request, protected=self.access.protect_metrics)
        if stop is not None:
            return stop
        if request.method != b"GET":
            request.setHeader(b"allow", b"GET")
            return send_error(request, GatewayError(405, "use GET"), shape="plain")
        return self.status_page.subscribe(request)

    @app.route("/status/<name>", methods=["GET", "HEAD"])
    def status_asset(self, request: IRequest, name: str) -> bytes:
        if name not in PAGE_FILES:
            return send_error(request, GatewayError(404, "no route for this path"), shape="plain")
        return send_asset(request, name)

    @app.route("/", branch=True)
    def everything_else(self, request: IRequest) -> Any:
        path = request.path
        if path.startswith(b"/llm/"):
            return send_error(
                request, GatewayError(404, f"no such endpoint: {path.decode('latin-1')}")
            )
        matched = self.proxy.match(path)
        if matched is None and path == b"/" and request.method in (b"GET", b"HEAD"):
            request.setResponseCode(302)
            request.setHeader(b"location", b"status")  # relative: right behind a path prefix
            return b""
        if matched is None:
            target = self.proxy.redirect_target(path)
            if target is not None:
                request.setResponseCode(308)
                request.setHeader(b"location", target)
                return b""
            return send_error(request, GatewayError(404, "no route for this path"), shape="plain")
        route, remainder = matched
        credentials = self.access.credential_headers(request)
        trusted = self.access.peer_trusted(request)
        return self._work(
            request,
            "proxy",
            lambda r: self.proxy.forward(request, r, route, remainder, credentials, trusted),
            shape="plain",
        )

    @app.handle_errors(NotFound)
    def unroutable(self, request: IRequest, failure: Failure) -> bytes:
        """A path even the catch-all cannot match (werkzeug's `path` converter stops at an
        encoded newline) in the JSON shape, not werkzeug's HTML page."""
        error = GatewayError(404, "no route for this path")
        return send_error(request, error, shape=shape_of(request.path))

    @app.handle_errors(Exception)
    def unexpected(self, request: IRequest, failure: Failure) -> bytes:
        """An exception no route expected, in a route that answers at once (the models, the
        status): one traceback and a 500 in the path's shape, never twisted.web's HTML page.
        (`InFlight` answers those of the routes that reach an upstream.)"""
        if failure.check(HTTPException):
            failure.raiseException()  # werkzeug's routing answers stay Klein's to give
        log.failure("Unhandled error answering {path}", failure, path=request.path)
        return send_error(request, internal_error(), shape=shape_of(request.path))


class AnsweredByItsFlight(Resource):
    """What a route returns to Klein for a request whose `InFlight` flight writes the answer
    and finishes the request itself (`InFlight.run(..., respond=True)`).

    Klein renders a returned resource at once and leaves the request to it: its per-request
    Deferred chain ends then, instead of holding three closures and four callback pairs on the
    handler's Deferred until the answer is written, which for a stream waiting in the line is
    minutes (~2.4 KB a waiter by tracemalloc). Of Klein's render, the two `notifyFinish`
    Deferreds it adds before it calls a route stay with the request (a closure that notes the
    end, a lambda that would cancel the route's Deferred, already fired). Rendering writes
    nothing (`NOT_DONE_YET`): the flight has begun, or even finished, the request. One object
    serves every request: nothing of it is per request.
    """

    isLeaf = True  # Klein consumed the route's path; nothing below it to look up

    def render(self, request: IRequest) -> Any:
        # Klein's URL map adapter, bound to the request for a route's `url_for`: the route has
        # run and Klein reads it no more, yet a stream would keep it for its wait (~0.7 KB).
        request.unsetComponent(IKleinRequest)  # type: ignore[attr-defined]
        return NOT_DONE_YET


ANSWERED_BY_ITS_FLIGHT = AnsweredByItsFlight()
