"""Metric names (worker, sidecar, external engines, operator) and their label names.

Part of the contract: names both sides must agree on, each defined once (see warmpool/contract/__init__.py)."""

from __future__ import annotations

# --------------------------------------------------------------------------- 7. metrics


# The worker's (built-in and sidecar), scraped by the operator.
METRIC_PHASE_TIMESTAMP = "warmpool_coldstart_phase_timestamp_seconds"  # label: phase
METRIC_PHASE_DURATION = "warmpool_coldstart_phase_duration_seconds"  # label: phase (since process start)
METRIC_TTFT = "warmpool_time_to_first_token_seconds"  # histogram
METRIC_MEMORY_USED_RATIO = "warmpool_accelerator_memory_used_ratio"
METRIC_MEMORY_USED_BYTES = "warmpool_accelerator_memory_used_bytes"
METRIC_MEMORY_CAPACITY_BYTES = "warmpool_accelerator_memory_capacity_bytes"
METRIC_TIER = "warmpool_tier"  # gauge per tier label: 1 for the active tier
#: The tier the worker's last warm-up ran at (gauge per tier label, 1 for that tier);
#: differs from METRIC_TIER while a deeper warm-up is still catching up after a relaxation.
METRIC_WARMUP_TIER = "warmpool_warmup_tier"
#: The tier the worker's own guard decided from its probe (gauge per tier label).
METRIC_LOCAL_TIER = "warmpool_local_tier"
#: 1 while an operator directive is in force (not expired).
METRIC_DIRECTIVE_ACTIVE = "warmpool_directive_active"
METRIC_LAYERS_RESIDENT = "warmpool_layers_resident"
METRIC_LAYERS_TOTAL = "warmpool_layers_total"
METRIC_WARMUP_PREFILLS = "warmpool_warmup_prefills_total"  # label: bucket
#: Warm-up prompts per bucket the worker's last warm-up plan asked for.
METRIC_WARMUP_PLANNED = "warmpool_warmup_planned_prefills"  # label: bucket
#: Warm-up prompts per bucket that plan needs with early settling counted: a bucket whose latency
#: settled needs the prefills it settled after (fewer than planned), the others what was planned.
#: The operator's progress (status.pods) counts done of these, so a settled warm-up reads complete.
METRIC_WARMUP_NEEDED = "warmpool_warmup_needed_prefills"  # label: bucket
METRIC_LAYER_HEAT = "warmpool_layer_heat"  # label: layer
#: 1, labelled with the checkpoint digest and layer count, so the operator can write a
#: heat map that applies to the model the workers loaded.
METRIC_MODEL_INFO = "warmpool_model_info"  # labels: digest, layers
METRIC_READY = "warmpool_ready"  # 1 when warm and serving
#: Tokens generated for served requests (warm-up excluded).
METRIC_GENERATED_TOKENS = "warmpool_generated_tokens_total"
#: Completions received (counted on arrival, whatever their outcome): the operator's idle signal
#: (a pod whose count has not moved for spec.pool.sleep.afterIdleSeconds is idle).
METRIC_REQUESTS_TOTAL = "warmpool_requests_total"
#: Completions received and not yet answered (the operator drains these before a sleep).
METRIC_REQUESTS_IN_FLIGHT = "warmpool_requests_in_flight"
#: Requests admitted and waiting for the engine (bounded by --max-queued-requests).
METRIC_REQUESTS_QUEUED = "warmpool_requests_queued"
#: Prompt and generated tokens per served request (histograms over TOKEN_LENGTH_EDGES); the
#: operator's learned warm-up buckets read the prompt one.
METRIC_REQUEST_PROMPT_TOKENS = "warmpool_request_prompt_tokens"
METRIC_REQUEST_GENERATED_TOKENS = "warmpool_request_generated_tokens"
#: Seconds the engine spent generating for served requests (the built-in engine: wall time of
#: its batch steps, so concurrent requests are not counted twice).  Tokens/s is a rate the reader
#: takes: rate(generated_tokens_total) is the throughput served, and rate(generated_tokens_total)
#: / rate(engine_busy_seconds_total) the throughput while busy, a pod's measured capacity.
METRIC_ENGINE_BUSY_SECONDS = "warmpool_engine_busy_seconds_total"
#: The built-in engine's busy seconds and the requests that finished, by the size of the batch
#: the step ran with (label LABEL_BATCH: the bucket of BATCH_SIZE_EDGES the size falls in, named
#: by its lower edge).  Per label, finished ÷ seconds is what a pod serves per busy second at
#: that batch size: its measured capacity curve (the operator sizes pools by the best point).
METRIC_ENGINE_BATCH_SECONDS = "warmpool_engine_batch_seconds_total"  # label: batch
METRIC_ENGINE_BATCH_FINISHED = "warmpool_engine_batch_finished_total"  # label: batch
#: Lower edges of the batch-size buckets (a size at or above the last edge is in the last bucket).
BATCH_SIZE_EDGES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
#: Requests refused before any work, by reason (queue_full).
METRIC_REQUESTS_REJECTED = "warmpool_requests_rejected_total"  # label: reason
#: Requests whose client went away before the completion was done.
METRIC_REQUESTS_CANCELLED = "warmpool_requests_cancelled_total"
#: Decode steps run after the client was seen gone (at most one per cancelled request).
METRIC_TOKENS_AFTER_DISCONNECT = "warmpool_tokens_after_disconnect_total"
#: KV-cache token slots allocated for the requests in flight (grows with generated tokens).
METRIC_KV_CACHE_TOKENS = "warmpool_kv_cache_tokens"
#: Capacity of the built-in engine's continuous batching: requests in the running batch (the
#: waiting ones are METRIC_REQUESTS_QUEUED), and its KV-cache blocks: all of them, those holding
#: K/V now (used), those reserved for running requests' next steps (reserved, >= used; never max_tokens),
#: and those a new request can still reserve (free = total - reserved).
METRIC_REQUESTS_RUNNING = "warmpool_requests_running"
METRIC_KV_BLOCKS_TOTAL = "warmpool_kv_blocks_total"
METRIC_KV_BLOCKS_USED = "warmpool_kv_blocks_used"
METRIC_KV_BLOCKS_RESERVED = "warmpool_kv_blocks_reserved"
METRIC_KV_BLOCKS_FREE = "warmpool_kv_blocks_free"
#: Tokens generated per second over the last TOKENS_PER_SECOND_WINDOW seconds (all requests).
METRIC_GENERATION_TOKENS_PER_SECOND = "warmpool_generation_tokens_per_second"
#: Warm-prefix KV files that could not be saved (ENOSPC, read-only, ...), by errno name.
METRIC_KV_PREFIX_SAVE_ERRORS = "warmpool_kv_prefix_save_errors_total"  # label: reason
#: Requests (and warm-up prefills) whose logits held NaN/Inf.
METRIC_NON_FINITE_LOGITS = "warmpool_non_finite_logits_total"
#: Sleep: the level slept at (0 when awake); sleeps and wakes done; wake seconds; the
#: memory the last sleep released (measured: process RSS on CPU, the allocator on CUDA);
#: completions that found the worker asleep and woke it.
METRIC_SLEEP_LEVEL = "warmpool_sleep_level"
METRIC_SLEEPS = "warmpool_sleeps_total"
METRIC_WAKES = "warmpool_wakes_total"
METRIC_WAKE_DURATION = "warmpool_wake_duration_seconds"  # histogram
METRIC_SLEEP_RELEASED_BYTES = "warmpool_sleep_released_bytes"
METRIC_WAKES_ON_REQUEST = "warmpool_wakes_on_request_total"
#: 1 when the engine can sleep, 0 when it has no sleep API (llama.cpp, TGI: never put it to
#: sleep); absent while the sidecar has not found out yet.
METRIC_SLEEP_CAPABLE = "warmpool_sleep_capable"

# The sidecar's own (`warmpool worker sidecar`).
METRIC_ENGINE_MEMORY_RATIO = "warmpool_engine_memory_used_ratio"  # the engine's own figure
#: 1 while the external engine answers its health endpoint, 0 while it does not.
METRIC_ENGINE_UP = "warmpool_engine_up"
#: Times the sidecar saw its engine restart or stop answering after it had answered.
METRIC_ENGINE_RESTARTS = "warmpool_engine_restarts_total"
#: Warm-up requests to the engine that failed, by reason (unavailable, http_5xx, ...).
METRIC_WARMUP_ERRORS = "warmpool_warmup_errors_total"  # label: reason
#: Weight bytes the sidecar's page-cache prefetch means to read at the current tier.
METRIC_PREFETCH_TARGET_BYTES = "warmpool_prefetch_target_bytes"
#: Weight bytes read so far by the prefetch.
METRIC_PREFETCH_READ_BYTES = "warmpool_prefetch_read_bytes"
#: Weight bytes of the prefetch's target found resident in the page cache (mincore).
METRIC_PREFETCH_RESIDENT_BYTES = "warmpool_prefetch_resident_bytes"
#: Weight files the prefetch could not use (missing, truncated, bad header).
METRIC_PREFETCH_FILE_ERRORS = "warmpool_prefetch_file_errors"

# An external engine's, read by the sidecar.

# The operator's own.
METRIC_OPERATOR_RECONCILE_SECONDS = "warmpool_operator_reconcile_duration_seconds"  # label: kind
METRIC_OPERATOR_RECONCILE_ERRORS = "warmpool_operator_reconcile_errors_total"  # labels: kind, reason
METRIC_OPERATOR_SCRAPE_FAILURES = "warmpool_operator_scrape_failures_total"  # label: reason
METRIC_OPERATOR_TIER_DECISIONS = "warmpool_operator_tier_decisions_total"  # labels: scope, tier
METRIC_OPERATOR_WARM_PODS = "warmpool_operator_warm_pods"  # labels: namespace, warmmodel
#: 1 while the WarmModel's last pass failed for good (its Degraded reason in label ``reason``), 0 with an
#: empty reason once a pass succeeds: one series per WarmModel from its first pass, failed or not.
METRIC_OPERATOR_DEGRADED = "warmpool_operator_warmmodel_degraded"  # labels: namespace, warmmodel, reason
#: The WarmModel's pool.minWarm, beside the warm count (the below-minWarm alert compares them).
METRIC_OPERATOR_MIN_WARM_PODS = "warmpool_operator_min_warm_pods"  # labels: namespace, warmmodel
METRIC_OPERATOR_WRITE_FAILURES = "warmpool_operator_write_failures_total"  # label: target (pod_annotation, heat_map)
#: Demand prediction's figures (status.forecast), per WarmModel with spec.pool.predictive (shadow
#: mode included); a figure not known yet has no series.  Labels: namespace, warmmodel.
#: The mean request rate over the last closed history step.
METRIC_OPERATOR_FORECAST_RATE_NOW = "warmpool_operator_forecast_rate_now_requests_per_second"
#: The forecast one lead time ahead, label quantile "0.5" (p50) and "0.9" (p90, what the pool is sized
#: for): of each step's PEAK rate (its busiest sub-step), the forecaster's default target; of the step's
#: mean only where the history holds no peaks.
METRIC_OPERATOR_FORECAST_PEAK = "warmpool_operator_forecast_peak_requests_per_second"
#: Requests per second one pod serves while busy, measured from the workers' throughput.
METRIC_OPERATOR_FORECAST_CAPACITY_PER_POD = "warmpool_operator_forecast_capacity_per_pod_requests_per_second"
#: Pods the forecast asks for (acted on only when spec.pool.predictive.enabled).
METRIC_OPERATOR_FORECAST_DESIRED_REPLICAS = "warmpool_operator_forecast_desired_replicas"

# Label names of the metrics above.
# The activator's (scale to zero), per WarmModel (labels namespace, warmmodel).
METRIC_ACTIVATOR_HELD = "warmpool_activator_held_requests"  # gauge: requests held now
METRIC_ACTIVATOR_HOLD_SECONDS = "warmpool_activator_hold_seconds"  # histogram: arrival -> forwarded or refused
METRIC_ACTIVATOR_REQUESTS = "warmpool_activator_requests_total"  # counter, label outcome
#: Seconds from a request's arrival at a pool at zero to the first byte of its answer (first token when streamed).
METRIC_ACTIVATOR_FIRST_BYTE_SECONDS = "warmpool_activator_zero_to_first_byte_seconds"  # histogram
METRIC_OPERATOR_AT_ZERO = "warmpool_operator_at_zero"  # gauge, labels namespace, warmmodel: 1 while the pool is at zero
# The node agent's (`warmpool node-agent`), per WarmModel (labels namespace, warmmodel).
#: Fills of this node's cache that failed, by stage: reading the revision's manifest from the model's
#: source (NODE_AGENT_STAGE_MANIFEST), or its blocks (NODE_AGENT_STAGE_BLOCKS).
METRIC_NODE_AGENT_FILL_FAILURES = "warmpool_node_agent_fill_failures_total"  # labels: namespace, warmmodel, stage
#: Revisions this agent published into the node's cache.
METRIC_NODE_AGENT_FILLS = "warmpool_node_agent_fills_total"  # labels: namespace, warmmodel
LABEL_STAGE = "stage"
NODE_AGENT_STAGE_MANIFEST = "manifest"
NODE_AGENT_STAGE_BLOCKS = "blocks"
LABEL_OUTCOME = "outcome"  # warmpool_activator_requests_total: forwarded, rejected_full, timed_out, client_gone, error
OUTCOMES = ("forwarded", "rejected_full", "timed_out", "client_gone", "error", "misdirected")

LABEL_PHASE = "phase"
LABEL_TIER = "tier"
LABEL_BUCKET = "bucket"
LABEL_LAYER = "layer"
LABEL_SOURCE = "source"
LABEL_REASON = "reason"
LABEL_DIGEST = "digest"
LABEL_LAYERS = "layers"
LABEL_KIND = "kind"
LABEL_SCOPE = "scope"
LABEL_TARGET = "target"  # warmpool_operator_write_failures_total: what the skipped write was for
LABEL_NAMESPACE = "namespace"
LABEL_WARMMODEL = "warmmodel"
LABEL_BATCH = "batch"  # warmpool_engine_batch_*: the batch-size bucket
LABEL_QUANTILE = "quantile"  # warmpool_operator_forecast_peak_requests_per_second: the forecast's quantile
#: Values of LABEL_QUANTILE: the forecast's p50 and p90.
FORECAST_QUANTILE_P50 = "0.5"
FORECAST_QUANTILE_P90 = "0.9"

#: Cold-start phases in the order they happen (each a timestamp and a duration since start).
#: imports_done: the engine's imports (torch) finished; weights_loaded: the tier's resident layers
#: are loaded (the built-in worker marks both; the sidecar has neither, so they are absent there).
PHASES = ("process_start", "imports_done", "weights_mapped", "first_layer_ready", "weights_loaded", "warmup_done",
          "ready")


def batch_bucket(size: int) -> int:
    """The BATCH_SIZE_EDGES bucket (its lower edge) a batch of ``size`` requests falls in."""
    if size < 1:
        raise ValueError(f"a batch holds at least one request, got {size}")
    return max(edge for edge in BATCH_SIZE_EDGES if edge <= size)

#: Scrape rounds cut short: a round still running past its bound (a stuck pool) is cancelled,
#: with every pool's scrape of it still in flight (operator; no labels).
METRIC_OPERATOR_SCRAPE_ROUNDS_CUT = "warmpool_operator_scrape_rounds_cut_total"

#: The built-in engine's scheduling: requests waiting for the running batch, those
#: preempted (their KV dropped to make room, recomputed when they run again) included; running
#: requests preempted because the KV cache ran out; requests that joined the batch ahead of one
#: that arrived earlier (shortest first, a client's share), and the seconds they waited to join.
METRIC_BATCH_WAITING = "warmpool_batch_waiting"
METRIC_BATCH_PREEMPTIONS = "warmpool_batch_preemptions_total"
METRIC_BATCH_OVERTAKES = "warmpool_batch_overtakes_total"
METRIC_BATCH_QUEUE_WAIT_SECONDS = "warmpool_batch_queue_wait_seconds_total"
