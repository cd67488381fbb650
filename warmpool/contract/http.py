"""The worker's HTTP surface: paths, ports, the control body, and the /readyz stages.

Part of the contract: names both sides must agree on, each defined once (see warmpool/contract/__init__.py)."""

from __future__ import annotations

# --------------------------------------------------------------------------- 5. the worker's HTTP surface

PATH_LIVEZ = "/livez"
PATH_READYZ = "/readyz"
PATH_METRICS = "/metrics"
PATH_CONTROL_TIER = "/control/tier"
#: The health path vLLM, SGLang, TGI and llama.cpp answer: the built-in worker answers it too
#: (200 only when warm, like /readyz), so tools that probe /health work unchanged.
PATH_HEALTH = "/health"
#: Sleep: POST puts the engine to sleep ({"level": 1|2}), GET reports the state; POST
#: /control/wake takes the memory back.  Authenticated like /control/tier.
PATH_CONTROL_SLEEP = "/control/sleep"
PATH_CONTROL_WAKE = "/control/wake"
CONTROL_FIELD_SLEEP_LEVEL = "level"
SLEEP_LEVELS = (1, 2)
#: vLLM's dev-mode sleep API (VLLM_SERVER_DEV_MODE=1): POST /sleep?level=N, POST /wake_up,
#: GET /is_sleeping -> {"is_sleeping": bool}.  The built-in worker serves it too.
PATH_VLLM_SLEEP = "/sleep"
PATH_VLLM_WAKE_UP = "/wake_up"
PATH_VLLM_IS_SLEEPING = "/is_sleeping"
DEFAULT_WORKER_PORT = 8080
#: The worker container's port name, which its Service targets and the chart's NetworkPolicy opens.
WORKER_PORT_NAME = "http"
DEFAULT_ENGINE_HEALTH_PATH = "/health"
#: The largest request body a worker accepts (aiohttp's default ``client_max_size``, which the
#: worker's servers keep): the activator refuses a larger one with 413 before it holds anything.
MAX_REQUEST_BODY_BYTES = 1024 * 1024
#: The serving API, the only part of a worker anything but the operator is meant to reach: paths
#: under it are what the activator forwards.
SERVING_API_PREFIX = "/v1/"

#: POST /control/tier: the bearer token's header and the body's keys ({"tier": "truncated", "ttl_seconds": 60}).
CONTROL_TOKEN_HEADER = "Authorization"  # "Bearer <token>"
CONTROL_FIELD_TIER = "tier"
CONTROL_FIELD_TTL = "ttl_seconds"
#: The operator's trace context in a tier directive's body (a W3C traceparent,
#: ``00-<trace id>-<span id>-<flags>``), so the worker's reaction joins the operator's trace.
CONTROL_FIELD_TRACEPARENT = "traceparent"

#: Stages a worker goes through, reported in the /readyz body as "stage".
STAGE_STARTING = "starting"  # HTTP bound, engine not yet mapped
STAGE_LOADING = "loading"  # weights mapped, layers loading in heat order
STAGE_WARMING = "warming"  # warm-up prompts running
STAGE_READY = "ready"  # warm: /readyz answers 200
STAGE_FAILED = "failed"  # load failed: the process is exiting non-zero
STAGE_UNHEALTHY = "unhealthy"  # was ready, then the model produced non-finite logits: unready for good
STAGES = (STAGE_STARTING, STAGE_LOADING, STAGE_WARMING, STAGE_READY, STAGE_FAILED, STAGE_UNHEALTHY)
#: Stage of a sidecar while its engine does not answer its health endpoint (at start, or
#: after the engine restarted or stopped answering: /readyz is 503 and warm-up runs again).
STAGE_WAITING_ENGINE = "waiting_engine"
