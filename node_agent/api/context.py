"""Request-scoped keys shared by the API's middlewares and handlers, and the constant label of
requests that name no loaded model."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..openapi import OPENAPI_PATH

__all__ = ["FLEET_INTERNAL", "HUNG_UP", "MODEL", "OPEN_PATHS", "REVISION", "UNKNOWN_LABEL"]

#: Paths answered without a key whatever the configuration (``/metrics`` by ``metrics_auth``).
OPEN_PATHS = frozenset({"/health", OPENAPI_PATH})

# Request-scoped keys (web.RequestKey where aiohttp has it: 3.11+).
_RequestKey = getattr(web, "RequestKey", None)
#: The model and revision a request was served by (set once the model is known to be loaded).
MODEL: Any = _RequestKey("mlxfleet_model", str) if _RequestKey else "mlxfleet_model"
REVISION: Any = _RequestKey("mlxfleet_revision", str) if _RequestKey else "mlxfleet_revision"
#: True when the request may pin a revision (PIN_HEADER): it authenticated with a fleet-internal
#: forward key, or the API has no keys at all (set by the authentication middleware).
FLEET_INTERNAL: Any = (_RequestKey("mlxfleet_fleet_internal", bool) if _RequestKey
                       else "mlxfleet_fleet_internal")
#: Set by a streaming handler that saw the client hang up after the 200 header went out.
HUNG_UP: Any = _RequestKey("mlxfleet_hung_up", bool) if _RequestKey else "mlxfleet_hung_up"
#: The model/revision label of requests that name no loaded model (unknown model, malformed
#: body, other routes): a constant, so that clients cannot create metric series at will.
UNKNOWN_LABEL = "unknown"
