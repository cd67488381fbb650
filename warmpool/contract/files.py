"""Files: ConfigMap keys, the heat map and learned-bucket formats, token length bins, and
where worker pods see things.

Part of the contract: names both sides must agree on, each defined once (see warmpool/contract/__init__.py)."""

from __future__ import annotations

# --------------------------------------------------------------------------- 8. files

#: Keys of the WarmModel's ConfigMap (mounted into worker pods as files of these names).
CONFIGMAP_KEY_PROMPTS = "prompts.json"
CONFIGMAP_KEY_HEATMAP = "heatmap.json"
#: The heat map file's format tag (see warmpool.heatmap).
HEATMAP_FORMAT = "warmpool.heatmap/v1"
LEARNED_BUCKETS_FORMAT = "warmpool.learned-buckets/v1"

#: Token lengths, as upper edges (inclusive) of bins: the buckets of the workers' token
#: histograms and the bins of the operator's history, so a learned warm-up bucket read off
#: either is a size engines pad graphs to: powers of two and the 1.5x step between them.
#: A length above the last edge falls in the overflow bin (+Inf).
TOKEN_LENGTH_EDGES: tuple[int, ...] = (
    16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144,
    8192, 12288, 16384, 24576, 32768, 49152, 65536, 98304, 131072,
)

#: The untied output head of a Llama-family checkpoint (HF names).  The built-in engine loads it
#: after the decoder layers (it is as large as the embeddings), so the node agent's hot-first fill
#: fetches it after them too, and a worker on a cache still filling reaches its first layer sooner.
OUTPUT_HEAD_TENSOR = "lm_head.weight"
#: How much of each safetensors file's tensor data (from its data start) goes into the worker's
#: model digest: opening a checkpoint reads it, so a fill for a worker starting on it fetches it first.
DIGEST_SAMPLE_BYTES = 64 * 1024

# Where worker pods see things.
#: The model's directory, whatever its source (an external engine's args point here,
#: e.g. `--model=/warmpool/model`).
MODEL_MOUNT_PATH = "/warmpool/model"
#: Where the node agent's content-addressed block cache lives on a node (warmpool_nodecache);
#: under /var/lib/warmpool, so inside host_paths.DEFAULT_ALLOWED_HOST_PATHS.
DEFAULT_BLOCK_CACHE_ROOT = "/var/lib/warmpool/cache"
MANIFEST_FILENAME = "warmpool-manifest.json"
#: Keys of the Secret that spec.model.s3.secretRef names (the AWS SDKs' own names, as
#: KServe's S3 secrets use them): the node agent reads these and nothing else -- the key pair
#: and, for temporary credentials, the session token; or instead a shared credentials file
#: (spec.model.s3.profile names its section).
S3_SECRET_ACCESS_KEY_ID_KEY = "AWS_ACCESS_KEY_ID"
S3_SECRET_SECRET_ACCESS_KEY_KEY = "AWS_SECRET_ACCESS_KEY"
S3_SECRET_SESSION_TOKEN_KEY = "AWS_SESSION_TOKEN"
S3_SECRET_CREDENTIALS_FILE_KEY = "credentials"
#: spec.model.s3.caBundle's key when it names none.
S3_CA_BUNDLE_DEFAULT_KEY = "ca.crt"
