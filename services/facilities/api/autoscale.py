"""/v1/autoscale/desired: the desired replica counts an operator's script (compose) polls."""

from __future__ import annotations

from fastapi import APIRouter, Request

from tokenyard.api_errors import ApiError
from tokenyard.services.facilities.api.schemas import AutoscaleDesired

router = APIRouter(prefix="/v1/autoscale", tags=["autoscale"])


@router.get("/desired", response_model=AutoscaleDesired)
async def desired(request: Request) -> AutoscaleDesired:
    advisor = request.app.state.advisor
    if advisor is None:
        raise ApiError(
            404,
            "the autoscaler is off (TOKENYARD_FACILITIES_AUTOSCALE_MODE=off)",
            code="autoscale_off",
        )
    return AutoscaleDesired(**advisor.as_json())
