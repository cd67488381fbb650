"""The worker's own default settings, in one place.

Plain constants with nothing imported: the command line reads them for its flags and
``--help`` (which must stay instant), and `config` for its dataclass defaults.  Names both
the operator and the worker use (port, buckets, tier thresholds, warm-up timeout) live in
`warmpool.contract` instead.
"""

from __future__ import annotations

#: The sidecar's flag naming the engine's sleep API (auto: probe vLLM's GET /is_sleeping).
ENGINE_SLEEP_APIS = ("auto", "vllm", "sglang", "none")


#: Warm-up prompts per length bucket at the full tier, and tokens decoded after each prefill.
DEFAULT_PROMPTS_PER_BUCKET = 2
DEFAULT_DECODE_TOKENS = 4
#: When a bucket's warm-up prefills have settled (`warmup.SettleRule`): the last two, of equal
#: length, within this fraction of the faster one.  A bucket's first prefill carries one-off
#: costs (first touch of the mapped weights, allocator growth, a kernel picked for a new shape:
#: tens of percent or more); two warm ones of one length differ by a few percent.  5 % is half
#: the 10 % a first request may be slower than steady (first/steady <= 1.1), so a bucket that
#: stops here has little left to gain from another prefill.
DEFAULT_SETTLE_TOLERANCE = 0.05
#: Prefills a bucket runs before it may count as settled: "two in a row" needs two.  The most
#: is the plan's prompts per bucket (--prompts-per-bucket, the fixed count before this rule).
DEFAULT_SETTLE_MIN_PREFILLS = 2
#: English BPE text averages about 4 characters a token; used only where no tokenizer is at hand.
DEFAULT_CHARS_PER_TOKEN = 4.0
#: Seconds between two readings of the local tier guard's memory probe.
DEFAULT_GUARD_INTERVAL_S = 0.5
#: Where the worker binds when neither --host nor the pod IP says otherwise.
DEFAULT_HOST = "127.0.0.1"
#: Tokens one step of the built-in engine may feed (decodes, then prefill chunks): a few chunks
#: beside a full batch's decodes, so new prompts start while the batch decodes, and a step stays
#: short.  The batch scheduler plans with it, and a generation alone takes the same steps.
DEFAULT_STEP_TOKENS = 256
#: Requests that may wait for the engine before the next one gets 429 + Retry-After.
DEFAULT_MAX_QUEUED_REQUESTS = 64
#: Default ceiling on max_tokens: bounds one request's compute (its KV grows with what it
#: generates, so the ceiling is about time held on the engine, not memory reserved up front).
DEFAULT_MAX_TOKENS_LIMIT = 4096
#: Seconds a completion waits for a sleeping engine to wake (level 2 re-reads the files).
DEFAULT_WAKE_TIMEOUT_S = 60.0
#: Where cgroup v2 is mounted (the CPU quota sizes torch's thread pool).
DEFAULT_CGROUP_ROOT = "/sys/fs/cgroup"

# -- sidecar: how the external engine is reached and watched ---------------------------
DEFAULT_ENGINE_METRICS_PATH = "/metrics"
DEFAULT_POLL_INTERVAL_S = 0.5
DEFAULT_LOST_AFTER = 3
DEFAULT_PROBE_TIMEOUT_S = 2.0
DEFAULT_REQUEST_TIMEOUT_S = 120.0
DEFAULT_RETRIES = 3
DEFAULT_RETRY_BACKOFF_S = 0.5

# -- serve: the batch the built-in engine runs -------------------------------------------
#: Bytes of KV cache the running batch may hold (blocks taken as tokens come; when they run out a
#: running request is preempted): what bounds how many requests run at once, with --max-batch-size.
DEFAULT_KV_CACHE_BYTES = 1 << 30
#: Requests the engine runs in one batch at most (the rest wait in the bounded queue).
DEFAULT_MAX_BATCH_SIZE = 16
#: Prompt tokens per prefill chunk: a prompt advances by one chunk a batch step (the scheduler's
#: step token budget holds a few chunks beside the decodes).
DEFAULT_PREFILL_CHUNK_TOKENS = 64
#: The prompt of the check prefill before ready when the warm-up ran none (a NaN checkpoint
#: must never turn Ready, even at the paused tier); its first token only.
READINESS_CHECK_PROMPT = "Hello"
#: Seconds a sleep waits for the batch to drain before it is refused.
DEFAULT_SLEEP_DRAIN_TIMEOUT_S = 60.0
