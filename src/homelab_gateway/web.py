"""The gateway's URL space as Klein routes: health, the /llm surface, then proxy routes.

Handlers here only pick what to run; the work lives in `llm.Messages` and `proxy.ReverseProxy`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from klein import Klein
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.web.iweb import IRequest

from homelab_gateway.config import ModelConfig
from homelab_gateway.errors import GatewayError
from homelab_gateway.llm import (
    Messages,
    Pool,
    new_request_id,
    run_cancellable,
    send_error,
    send_json,
)
from homelab_gateway.proxy import ReverseProxy

MODEL_CREATED_AT = "2025-01-01T00:00:00Z"


class GatewayApp:
    app = Klein()

    def __init__(
        self,
        *,
        models: Mapping[str, ModelConfig],
        pools: Mapping[str, Pool],
        proxy: ReverseProxy,
        clock: IReactorTime,
        ping_interval: float,
        max_body_bytes: int,
    ) -> None:
        self.models = models
        self.pools = pools
        self.proxy = proxy
        self.clock = clock
        self.messages = Messages(
            models=models,
            pools=pools,
            clock=clock,
            ping_interval=ping_interval,
            max_body_bytes=max_body_bytes,
        )

    @app.route("/healthz", methods=["GET", "HEAD"])
    def healthz(self, request: IRequest) -> bytes:
        return send_json(request, 200, {"status": "ok"})

    @app.route("/llm/v1/messages")
    def messages_route(self, request: IRequest) -> Deferred[Any]:
        return self.messages.render(request)

    @app.route("/llm/v1/messages/count_tokens")
    def count_tokens(self, request: IRequest) -> Deferred[Any]:
        request.setHeader(b"request-id", new_request_id().encode())
        return run_cancellable(request, self._count_tokens(request))

    async def _count_tokens(self, request: IRequest) -> bytes:
        if request.method != b"POST":
            return send_error(request, GatewayError(405, "use POST for /v1/messages/count_tokens"))
        try:
            _, pool, mapped = self.messages.resolve(request, count_only=True)
        except GatewayError as e:
            return send_error(request, e)
        count = await self._tokenize(pool, mapped.body)
        return send_json(request, 200, {"input_tokens": count or mapped.estimated_input_tokens})

    async def _tokenize(self, pool: Pool, body: Mapping[str, Any]) -> int | None:
        """vLLM's exact count from its /tokenize (beside /v1); None where there is none."""
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
        try:
            response = await upstream.open(
                "POST", base + "/tokenize", headers, json.dumps(payload).encode()
            )
            text = await upstream.read_limited(response)
        except GatewayError:
            return None
        if response.code != 200:
            return None
        try:
            count = json.loads(text).get("count")
        except (ValueError, AttributeError):
            return None
        return count if isinstance(count, int) and count >= 0 else None

    @app.route("/llm/v1/models", methods=["GET"])
    def list_models(self, request: IRequest) -> bytes:
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

    @app.route("/llm/v1/models/<path:name>", methods=["GET"])
    def get_model(self, request: IRequest, name: str) -> bytes:
        if name not in self.models:
            return send_error(request, GatewayError(404, f"model: {name!r} is not served here"))
        return send_json(request, 200, _model_entry(name))

    @app.route("/llm/v1/status", methods=["GET"])
    def status(self, request: IRequest) -> bytes:
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
            return send_json(
                request, 404, GatewayError(404, "no route for this path").openai_body()
            )
        return run_cancellable(request, self.proxy.forward(request, *matched))


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
