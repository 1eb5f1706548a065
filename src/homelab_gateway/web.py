"""The gateway's URL space as Klein routes: health and metrics, the /llm surface, proxy routes.

Handlers only choose what runs. `_work` is the one door for requests that reach an upstream
(access checks, a RequestRecord, InFlight); `_light` guards the informational endpoints.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine, Mapping
from datetime import UTC, datetime
from typing import Any

from klein import Klein
from prometheus_client.twisted import MetricsResource
from twisted.web.iweb import IRequest

from homelab_gateway.access import AccessPolicy
from homelab_gateway.config import ModelConfig
from homelab_gateway.errors import GatewayError
from homelab_gateway.inflight import InFlight
from homelab_gateway.llm import Messages
from homelab_gateway.pool import Pool
from homelab_gateway.proxy import ReverseProxy
from homelab_gateway.readiness import Readiness
from homelab_gateway.respond import new_request_id, send_error, send_json
from homelab_gateway.telemetry import RequestRecord, Telemetry

MODEL_CREATED_AT = "2025-01-01T00:00:00Z"
TOKENIZE_BODY_LIMIT = 8 * 1024 * 1024
"""vLLM's /tokenize answer lists every token id (about 7 bytes each): 8 MiB covers a
million-token prompt, where the 64 KiB error-body limit would cut a long prompt's answer
short and fall back to the estimate."""

Work = Callable[[RequestRecord], Coroutine[Any, Any, Any]]


class GatewayApp:
    app = Klein()

    def __init__(
        self,
        *,
        models: Mapping[str, ModelConfig],
        pools: Mapping[str, Pool],
        proxy: ReverseProxy,
        messages: Messages,
        access: AccessPolicy,
        inflight: InFlight,
        telemetry: Telemetry,
        readiness: Readiness,
    ) -> None:
        self.models = models
        self.pools = pools
        self.proxy = proxy
        self.messages = messages
        self.access = access
        self.inflight = inflight
        self.telemetry = telemetry
        self.readiness = readiness
        self.metrics_resource = MetricsResource(telemetry.registry)

    def _work(self, request: IRequest, surface: str, work: Work, *, anthropic: bool) -> Any:
        request_id = new_request_id()
        request.setHeader(b"request-id", request_id.encode())
        self.access.add_cors_headers(request)
        if self.access.cors_origins and self.access.is_preflight(request):
            return self.access.preflight(request)
        record = self.telemetry.start(request_id, surface, request.method, request.path)
        refusal = self.access.refusal(request, protected=True, draining=self.inflight.draining)
        if refusal is not None:
            record.outcome, record.status = refusal.outcome, refusal.status
            self.telemetry.finish(record)
            return send_error(request, refusal, anthropic=anthropic)
        return self.inflight.run(request, record, work(record))

    def _light(self, request: IRequest, *, protected: bool) -> bytes | None:
        """CORS and, where `protected`, the API key for a read-only endpoint; an answer if the
        request stops here."""
        self.access.add_cors_headers(request)
        if self.access.is_preflight(request):
            return self.access.preflight(request)
        refusal = self.access.refusal(request, protected=protected, draining=False)
        return None if refusal is None else send_error(request, refusal)

    @app.route("/healthz", methods=["GET", "HEAD"])
    def healthz(self, request: IRequest) -> bytes:
        return send_json(request, 200, {"status": "ok"})

    @app.route("/readyz", methods=["GET", "HEAD"])
    def readyz(self, request: IRequest) -> bytes:
        ready, upstreams = self.readiness.report()
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

    @app.route("/llm/v1/messages")
    def messages_route(self, request: IRequest) -> Any:
        return self._work(
            request, "messages", lambda r: self.messages.answer(request, r), anthropic=True
        )

    @app.route("/llm/v1/messages/count_tokens")
    def count_tokens(self, request: IRequest) -> Any:
        return self._work(
            request, "count_tokens", lambda r: self._count_tokens(request, r), anthropic=True
        )

    async def _count_tokens(self, request: IRequest, record: RequestRecord) -> bytes:
        if request.method != b"POST":
            return send_error(request, GatewayError(405, "use POST for /v1/messages/count_tokens"))
        try:
            pool, mapped = self.messages.resolve(request, record, count_only=True)
        except GatewayError as e:
            record.outcome = e.outcome
            return send_error(request, e)
        count = await self._tokenize(pool, mapped.body)
        record.input_tokens = count or mapped.estimated_input_tokens
        return send_json(request, 200, {"input_tokens": record.input_tokens})

    async def _tokenize(self, pool: Pool, body: Mapping[str, Any]) -> int | None:
        """vLLM's exact count from its /tokenize (beside /v1); None where there is none, or
        when no tokenizer place came free within `connect_timeout` (see pool.hold_tokenizer)."""
        upstream = pool.upstream
        base = upstream.url.removesuffix("/v1")
        payload = {
            "model": body["model"],
            "messages": body["messages"],
            "add_generation_prompt": True,
        }
        if "tools" in body:
            payload["tools"] = body["tools"]
        headers = {b"content-type": [b"application/json"]}
        place = await pool.hold_tokenizer(self.messages.clock)
        if place is None:
            return None
        try:
            response = await upstream.open(
                "POST", base + "/tokenize", headers, json.dumps(payload).encode()
            )
            text = await upstream.read_limited(response, TOKENIZE_BODY_LIMIT)
        except GatewayError:
            return None
        finally:
            place.release()
        if response.code != 200:
            return None
        try:
            count = json.loads(text).get("count")
        except (ValueError, AttributeError):
            return None
        return count if isinstance(count, int) and count >= 0 else None

    @app.route("/llm/v1/models", methods=["GET", "OPTIONS"])
    def list_models(self, request: IRequest) -> bytes:
        stop = self._light(request, protected=True)
        if stop is not None:
            return stop
        data = [_model_entry(name) for name in self.models]
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
        if name not in self.models:
            return send_error(request, GatewayError(404, f"model: {name!r} is not served here"))
        return send_json(request, 200, _model_entry(name))

    @app.route("/llm/v1/status", methods=["GET", "OPTIONS"])
    def status(self, request: IRequest) -> bytes:
        stop = self._light(request, protected=self.access.protect_metrics)
        if stop is not None:
            return stop
        upstreams = {
            name: {
                "slots": pool.slots.limit,
                "in_use": pool.slots.in_use,
                "waiting": len(pool.slots.waiting),
            }
            for name, pool in self.pools.items()
        }
        return send_json(request, 200, {"upstreams": upstreams})

    @app.route("/", branch=True)
    def everything_else(self, request: IRequest) -> Any:
        path = request.path
        if path.startswith(b"/llm/"):
            return send_error(
                request, GatewayError(404, f"no such endpoint: {path.decode('latin-1')}")
            )
        matched = self.proxy.match(path)
        if matched is None:
            target = self.proxy.redirect_target(path)
            if target is not None:
                request.setResponseCode(308)
                request.setHeader(b"location", target)
                return b""
            return send_error(request, GatewayError(404, "no route for this path"), anthropic=False)
        route, remainder = matched
        credential = self.access.credential_header(request)
        return self._work(
            request,
            "proxy",
            lambda r: self.proxy.forward(request, r, route, remainder, credential),
            anthropic=False,
        )


def _model_entry(name: str) -> dict[str, Any]:
    created = datetime.fromisoformat(MODEL_CREATED_AT)
    return {
        "id": name,
        "type": "model",
        "display_name": name,
        "created_at": MODEL_CREATED_AT,
        "object": "model",
        "created": int(created.replace(tzinfo=UTC).timestamp()),
        "owned_by": "homelab-gateway",
    }
