"""The operator's fleet routes (the operator key guards /admin/ once any key is set, gate.py):

    GET  /admin/fleet          the replicas as this gateway sees them, moves, drains, and
                               with --autoscale the autoscaler (bounds, last decisions)
    POST /admin/fleet/scale    {"replicas": N}: aim for N replicas (202, with what changes);
                               with --autoscale, N within its bounds, told to it first

Scaling needs a fleet (`serve --replicas` or `--ray-address`): one engine process answers
400.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from tokenfleet.cluster.scaling import MAX_REPLICAS
from tokenfleet.engine.replica_client import ReplicaClient
from tokenfleet.errors import InvalidRequestError
from tokenfleet.server.body import read_body
from tokenfleet.server.errors import APIError
from tokenfleet.server.schemas import request_body

if TYPE_CHECKING:
    from tokenfleet.cluster.client import FleetClient

router = APIRouter()


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: StrictInt = Field(ge=1, le=MAX_REPLICAS, description="the fleet's size to aim for")


def fleet_of(client: ReplicaClient) -> FleetClient | None:
    from tokenfleet.cluster.client import FleetClient

    return client if isinstance(client, FleetClient) else None


@router.get("/admin/fleet")
async def fleet(request: Request) -> JSONResponse:
    client: ReplicaClient = request.app.state.client
    body: dict[str, Any] = {"replicas": client.describe(), "moves": client.num_moves}
    fleet_client = fleet_of(client)
    if fleet_client is not None:
        body.update(fleet_client.scaler.describe())
        body.update(fleet_client.describe_health())
    autoscaling = getattr(request.app.state, "autoscaling", None)
    if autoscaling is not None:
        body["autoscaler"] = await autoscaling.describe()
    return JSONResponse(body)


@router.post("/admin/fleet/scale", openapi_extra=request_body(ScaleRequest))
async def scale(request: Request) -> JSONResponse:
    body = await read_body(request, ScaleRequest)
    fleet_client = fleet_of(request.app.state.client)
    if fleet_client is None:
        message = "scaling needs a fleet of replicas (serve --replicas or --ray-address)"
        raise APIError(400, "invalid_request", message)
    autoscaling = getattr(request.app.state, "autoscaling", None)
    try:
        if autoscaling is not None:  # the autoscaler records it (cool-downs count from it)
            plan = await autoscaling.manual(body.replicas)
        else:
            plan = fleet_client.scale(body.replicas)
    except InvalidRequestError as exc:
        raise APIError(400, "invalid_request", exc.message, param=exc.param) from exc
    return JSONResponse(plan, status_code=202)
