"""The FastAPI application: lifespan (engine process up and down), auth, request ids,
health, models and metrics; the two API routers do the rest."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from tokenfleet.batch.store import BatchStore
from tokenfleet.checkpoint.folder import resolve_model_folder
from tokenfleet.config import EngineConfig
from tokenfleet.engine.client import AsyncEngineClient
from tokenfleet.engine.replica_client import ReplicaClient
from tokenfleet.fleet.router import RouterConfig
from tokenfleet.server import (
    admin,
    anthropic_api,
    anthropic_batches,
    openai_batches,
    openai_chat,
    openai_completions,
)
from tokenfleet.server.anthropic_batches import iso
from tokenfleet.server.batch_start import start_batches
from tokenfleet.server.errors import (
    APIError,
    error_response,
    is_anthropic_request,
    request_id,
    validation_error,
)
from tokenfleet.server.gate import Gate
from tokenfleet.server.keys import CALLER_GROUP, Owners
from tokenfleet.server.limits import RateLimited
from tokenfleet.server.metrics import Metrics
from tokenfleet.server.offload import GatewayTokenizer
from tokenfleet.server.service import GenerationService
from tokenfleet.server.settings import ServeConfig
from tokenfleet.server.shared_limits import SharedRateLimiter

logger = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]

# The generation routes: served in front of FastAPI's stack (Gateway), and on the routers.
DIRECT_ROUTES: dict[str, Endpoint] = {
    "/v1/messages": anthropic_api.create_message,
    "/v1/chat/completions": openai_chat.chat_completions,
    "/v1/completions": openai_completions.completions,
}


def _internal_error(request: Request) -> JSONResponse:
    """A 500 in the API's format for an unexpected exception (logged, being handled)."""
    logger.exception("unhandled error on %s", request.url.path)
    return error_response(request, APIError(500, "internal", "internal server error"))


class Gateway(FastAPI):
    """The FastAPI app, with request ids, API keys and the generation routes handled in
    front of its middleware stack, as plain ASGI.

    Starlette's BaseHTTPMiddleware would pass every streamed chunk through an extra stream
    and task, on the time-per-token path. And routing, dependency solving and the exception
    middleware are work each request of a burst does one after another on the event loop
    before it reaches the engine: the generation routes (DIRECT_ROUTES) skip them, and turn
    their own errors into each API's error format."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        pending = self.state.service.pending
        pending.entered()
        request = Request(scope, receive)
        rid = request_id(request)
        gate: Gate = self.state.gate
        # Keys (any header bytes: a 401, never a 500), the operator key for /metrics.
        refused, group = gate.authorize(request)
        if refused is not None:
            pending.passed()
            await error_response(request, refused)(scope, receive, send)
            return
        CALLER_GROUP.set(group)  # the service's limits and prefix-cache salt read it
        # A large body of a route that tokenizes is read and checked off the event loop.
        receive, reply = await gate.precheck(request)
        if reply is not None:
            pending.passed()
            await reply(scope, receive, send)
            return
        request = Request(scope, receive)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["request-id"] = rid  # Anthropic's clients read this one,
                headers["x-request-id"] = rid  # OpenAI's this one
            await send(message)

        endpoint = DIRECT_ROUTES.get(scope["path"]) if scope["method"] == "POST" else None
        if endpoint is None:
            pending.passed()  # not a generation request: the engine need not wait for it
            await super().__call__(scope, receive, send_with_id)
            return
        scope["app"] = self  # as Starlette sets it: the endpoints find their state there
        # The key group's concurrency and requests per minute (its tokens per minute are
        # charged as the service submits each engine request).
        anthropic = is_anthropic_request(request)
        limited_send = gate.wrap_send(send_with_id, group, anthropic)
        limited = await gate.enter(request, group)
        if limited is not None:
            pending.passed()
            await limited(scope, receive, limited_send)
            return
        try:
            try:
                response = await endpoint(request)
            except RateLimited as exc:
                pending.passed()
                response = gate.refused(request, exc, group)
            except APIError as exc:
                pending.passed()
                response = error_response(request, exc)
            except Exception:
                pending.passed()
                response = _internal_error(request)
            await response(scope, receive, limited_send)
        finally:
            gate.leave(group)


def create_app(config: ServeConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        folder = resolve_model_folder(config.engine.model)
        engine_config = config.engine
        if engine_config.model is None:
            from dataclasses import replace

            engine_config = replace(engine_config, model=str(folder))
        client = _replica_client(config, engine_config)
        fleet_client = admin.fleet_of(client)
        metrics = Metrics(
            lambda: client.stats,
            client.replica_stats,
            lambda: client.num_moves,
            fleet_client.scaler if fleet_client is not None else None,
            fleet_client.health if fleet_client is not None else None,
        )
        app.state.client = client
        app.state.metrics = metrics
        app.state.service = GenerationService(
            client, GatewayTokenizer(folder), config, metrics, app.state.server_tasks
        )
        app.state.gate = Gate(config, app.state.service, metrics)
        app.state.started = int(time.time())
        await client.start()
        owners = Owners(config.key_groups)
        batches = await start_batches(config.batch, app.state.service, client, metrics, owners)
        app.state.batches = batches
        app.state.autoscaling = None
        if fleet_client is not None and config.fleet is not None and config.fleet.autoscale:
            from tokenfleet.cluster.autoscaling import fleet_autoscaling
            from tokenfleet.server.autoscale import GatewayWindow

            gather = GatewayWindow(fleet_client, app.state.service.window, batches.store)
            app.state.autoscaling = fleet_autoscaling(fleet_client, config.fleet, gather)
            app.state.autoscaling.start()
        shared_limits = None
        if config.limits_shared:  # one allowance per key group for every gateway on the store
            store = batches.dispatcher.store
            shared_limits = SharedRateLimiter(config.limits, store, config.batch.gateway_id)
            await shared_limits.start()
            app.state.service.limiter = shared_limits
        # Everything loaded so far lives as long as the server: keep the collector from
        # walking it again on every full collection (a pause in every stream).
        gc.collect()
        gc.freeze()
        # And collect the young generation after 100,000 allocations instead of 700: a
        # burst of 32 requests allocates enough for dozens of collections otherwise, each
        # on the event loop the burst waits on (about 1 ms of a burst of 32's first-token
        # overhead, bench/gateway_overhead.py). A few MB more held at most.
        gc.set_threshold(100_000, 50, 100)
        try:
            yield
        finally:
            if app.state.autoscaling is not None:
                await app.state.autoscaling.stop()
            app.state.gate.offloader.shutdown()
            if shared_limits is not None:
                await shared_limits.close()
            await batches.dispatcher.stop()
            batches.store.close()
            await client.shutdown()

    app = Gateway(title="tokenfleet", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.config = config
    # The HTTP server's request tasks, where it exposes them (`tokenfleet serve` sets them
    # before starting): the gateway counts the requests on their way to the engine.
    app.state.server_tasks = None

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_params(request: Request, exc: RequestValidationError) -> JSONResponse:
        # A bad query or path parameter (limit=abc): a 400 naming it, in the API's format.
        return error_response(request, validation_error(list(exc.errors()), skip=1))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing errors (an unknown path, a wrong method) in the API's own error format.
        path, status = request.url.path, exc.status_code
        if status == 404:
            message = f"invalid URL ({request.method} {path})"
        elif status == 405:
            message = f"method {request.method} not allowed on {path}"
        else:
            message = str(exc.detail)
        kind = "not_found" if status == 404 and is_anthropic_request(request) else "invalid_request"
        response = error_response(request, APIError(status, kind, message))
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return _internal_error(request)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        # As before: 200 while the engine runs, 503 while it is down (being restarted).
        client: ReplicaClient = request.app.state.client
        if client.is_healthy():
            return JSONResponse({"status": "ok", "engine_pid": client.pid})
        return JSONResponse({"status": "engine unavailable", "down": ["engine"]}, status_code=503)

    @app.get("/health/live")
    async def live(request: Request) -> JSONResponse:
        # Liveness: the gateway answers (a restart of the engine is not a reason to kill it).
        return JSONResponse({"status": "ok"})

    @app.get("/health/ready")
    async def ready(request: Request) -> JSONResponse:
        # Readiness: 200 only when the engine and the batch store are up; else 503 naming
        # each part down.
        client: ReplicaClient = request.app.state.client
        store_up = await asyncio.to_thread(_store_is_up, request.app.state.batches.store)
        parts = {"engine": "up" if client.is_healthy() else "down"}
        parts["store"] = "up" if store_up else "down"
        down = [name for name, state in parts.items() if state == "down"]
        body: dict[str, Any] = {"status": "unavailable" if down else "ok"}
        body.update(parts=parts, down=down)
        if client.is_healthy():
            body["engine_pid"] = client.pid
        return JSONResponse(body, status_code=503 if down else 200)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        registry = request.app.state.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def model_object(request: Request) -> dict[str, Any]:
        """The served model, in the fields of both APIs' model objects."""
        name, created = config.served_model_name, request.app.state.started
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "tokenfleet",
            "type": "model",
            "display_name": name,
            "created_at": iso(created),
        }

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        name = config.served_model_name
        return JSONResponse(
            {
                "object": "list",
                "data": [model_object(request)],
                "has_more": False,
                "first_id": name,
                "last_id": name,
            }
        )

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        request.app.state.service.check_model(model_id)
        return JSONResponse(model_object(request))

    app.include_router(anthropic_batches.router)  # before /v1/messages/{...} could shadow it
    app.include_router(anthropic_api.router)
    app.include_router(openai_chat.router)
    app.include_router(openai_completions.router)
    app.include_router(openai_batches.router)
    app.include_router(admin.router)
    return app


def _replica_client(config: ServeConfig, engine: EngineConfig) -> ReplicaClient:
    """One local engine process, or the fleet on Ray (`--replicas`, `--ray-address`)."""
    if config.fleet is None:
        return AsyncEngineClient(engine, heartbeat_timeout_s=config.heartbeat_timeout_s)
    from tokenfleet.cluster.client import FleetClient
    from tokenfleet.cluster.health import SlowRule
    from tokenfleet.cluster.placement import RayFleet

    fleet = config.fleet
    # The bundled model converts itself on each replica's node; a folder must be on each.
    engine = config.engine
    return FleetClient(
        engine,
        RayFleet(fleet, engine),
        router_config=RouterConfig(policy=fleet.router),
        replica_timeout_s=fleet.replica_timeout_s,
        max_moves=fleet.max_moves,
        move_wait_s=fleet.move_wait_s,
        drain_grace_s=fleet.drain_grace_s,
        fence_timeout_s=fleet.fence_timeout_s,
        slow_rule=SlowRule(fleet.slow_replica_factor),
        ttft_target_s=config.ttft_target_s,
        gateway_id=f"{config.batch.gateway_id}-{uuid.uuid4().hex[:8]}",
    )


def _store_is_up(store: BatchStore) -> bool:
    """Whether the batch store answers a trivial query (readiness)."""
    try:
        with store.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except Exception:
        logger.warning("batch store check failed", exc_info=True)
        return False
    return True
