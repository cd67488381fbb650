"""The contract between the built-in engine and the code that warms and serves it.

The `engine` package implements `Engine`; `warmup.py`, `server.py` and the sidecar use only what is
declared here, so the serving side never reaches into torch internals.  Nothing here
imports torch: the module is cheap to import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

#: progress callback: (layers resident, layers total, index of the layer just loaded)
LayerProgress = Callable[[int, int, int], None]


class ModelLoadError(RuntimeError):
    """The model directory or its files are unusable; the message names the file and the problem."""


class WeightsChangedError(ModelLoadError):
    """A weight file changed in place after it was validated (inode, size or mtime differ).

    The mapped pages may be gone (a truncated file would kill the process with SIGBUS) or
    hold other weights: the worker cannot go on serving, so it turns unready and exits for
    a restart.  Weights must be replaced by rename, never rewritten in place.
    """


class RequestError(ValueError):
    """A request the engine cannot serve (prompt too long, bad parameters): answered with a 4xx."""


class NonFiniteLogitsError(ModelLoadError):
    """The model produced NaN/Inf logits: its weights (or its dtype) are unusable.

    Raised by `Engine.prefill`/`generate` instead of sampling from garbage.  During warm-up it
    fails the start (the worker exits non-zero, never ready); on a served request it is a 5xx
    and the worker turns unready for good.  The message names the model and, where one is
    found, the weight that holds the non-finite values.
    """


@dataclass(frozen=True)
class GenerationStep:
    """One generated token; `text` is the detokenised increment (may be empty mid-codepoint)."""

    token_id: int
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" when finished


class Engine(Protocol):
    @property
    def model_name(self) -> str:
        """The name served on /v1/models (the model directory's name unless configured)."""

    @property
    def model_digest(self) -> str:
        """A stable digest of config + tensor headers: keys persisted warm-prefix KV files."""

    @property
    def num_layers(self) -> int: ...

    @property
    def max_context(self) -> int:
        """Longest prompt + completion in tokens (from config.json max_position_embeddings)."""

    @property
    def device(self) -> str:
        """'cpu' or 'cuda:N'."""

    def layers_resident(self) -> int:
        """How many decoder layers are materialised now."""

    def load_layers(self, order: Sequence[int], progress: LayerProgress | None = None) -> None:
        """Materialise embeddings and norm, then these decoder layers in this order, then an untied
        output head once no layer is left to load (an empty order: embeddings, norm and head alone).

        Idempotent; a layer not yet loaded is loaded on first use anyway, so a request can
        never see a missing weight.
        """

    def layer_heat(self) -> dict[int, float]:
        """Per-layer access counts with time decay (higher is hotter)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def prefill(self, token_ids: Sequence[int]) -> None:
        """Run one forward pass over these tokens (warm-up; results discarded).

        Raises RequestError if the prompt is empty or longer than max_context, and
        NonFiniteLogitsError if the logits hold NaN/Inf.
        """

    def generate(
        self, token_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0
    ) -> Iterator[GenerationStep]:
        """Prefill then decode, yielding one step per token.  Greedy when temperature == 0.

        Raises NonFiniteLogitsError (before yielding that step) if a step's logits hold NaN/Inf.
        """

    def save_prefix_kv(self, token_ids: Sequence[int], path: Path) -> None:
        """Persist the KV cache of this prefix as safetensors, keyed by model digest and token hash."""

    def load_prefix_kv(self, token_ids: Sequence[int], path: Path) -> bool:
        """mmap a persisted prefix back; False (and nothing loaded) if the file is stale or mismatched.

        A corrupt file raises ModelLoadError naming the file.
        """


@runtime_checkable
class KVCacheStats(Protocol):
    """Optional: an engine that reports the KV cache it holds for requests in flight."""

    def kv_cache_tokens(self) -> int:
        """Token slots (rows x positions) allocated now for live generations; grows with the
        tokens generated, never sized up front for ``max_tokens``."""
        ...


@dataclass(frozen=True)
class KVBlockStats:
    """The KV blocks the batch shares: all of them, those holding K/V now (used), those
    promised to admitted requests (reserved, >= used), and those a new request may still
    reserve (free = total - reserved)."""

    total: int
    used: int
    reserved: int
    free: int
    block_tokens: int


@runtime_checkable
class BatchingEngine(Protocol):
    """An engine that runs many generations in one batch, joining and leaving at token
    boundaries (the built-in engine).  One thread drives it (`batch_scheduler`): it opens a
    sequence per request, reserves its KV blocks, steps the running ones together and closes
    each when it ends.  A sequence is opaque here; the engine's own type carries its state."""

    def open_sequence(self, token_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0) -> Any:
        """A sequence ready to join the batch (nothing computed, nothing reserved); RequestError
        if the engine cannot serve it.  It has ``blocks_needed`` (its most, prompt + budget),
        ``prefilling``, ``finished`` and ``lease`` (``bounded``, ``try_reserve(blocks) -> bool``)."""
        ...

    def next_tokens(self, sequence: Any, after: int = 0) -> int:
        """Tokens the sequence's next step feeds (1 for a decode, a chunk for a prefill); with
        ``after`` of its chunks already planned for that step, the next one's (0: none left)."""
        ...

    def blocks_wanted(self, sequence: Any) -> int:
        """KV blocks to reserve for it, beyond those its lease holds, before its next step."""
        ...

    def preempt_sequence(self, sequence: Any) -> None:
        """Drop its KV (blocks given back); its next step recomputes what it had."""
        ...

    def step(self, sequences: Sequence[Any]) -> Sequence[Any]:
        """Advance these sequences by one step together: an outcome per sequence that took
        part (``sequence``, ``step``: a GenerationStep or None mid-prefill, ``error``).  A
        prefilling sequence given k times advances by k chunks (an outcome for each)."""
        ...

    def close_sequence(self, sequence: Any) -> None:
        """Give back its KV blocks; idempotent."""
        ...

    def kv_blocks(self) -> KVBlockStats: ...


@runtime_checkable
class GraphCapture(Protocol):
    """Optional: an engine that can capture its decode step as CUDA graphs (the built-in one can).

    Warm-up calls it after every layer is resident, when the tier allows (graphs cost memory):
    ``if isinstance(engine, GraphCapture): engine.capture_graphs()``.
    """

    def capture_graphs(self, buckets: Sequence[int] = (1, 2, 4, 8)) -> dict[int, float]:
        """Capture one graph per decode batch bucket; seconds per bucket ({} when not on CUDA)."""
        ...


@runtime_checkable
class Sleepable(Protocol):
    """Optional: an engine that can release its memory while idle and take it back (vLLM's
    sleep levels: 1 keeps the weights in host memory, 2 drops them and re-reads the files)."""

    @property
    def sleep_level(self) -> int | None:
        """The level it sleeps at, or None when awake."""
        ...

    def sleep(self, level: int) -> None: ...

    def wake(self) -> None:
        """Take the memory back and check one prompt gives finite logits before returning."""
        ...
