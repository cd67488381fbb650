"""An honest stand-in for `engine_api.Engine` with no torch: for tests of the serving side.

It keeps the contract's behaviour (lazy layer loads on first use, RequestError on empty or
oversize prompts, a real token loop over a small vocabulary, per-layer heat with decay,
prefix-KV files that reject a mismatch) so tests of the server, the guard and warm-up
exercise real control flow.  Tests construct it directly; no deployment ever sees it.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from warmpool_worker.engine_api import GenerationStep, LayerProgress, ModelLoadError, RequestError
from warmpool_worker.layer_heat import LayerHeat

VOCAB = 512
EOS = 1
_WORD = re.compile(r"\w+|[^\w\s]")


class FakeEngine:
    def __init__(
        self, name: str, num_layers: int = 8, max_context: int = 2048, layer_seconds: float = 0.0
    ) -> None:
        self._name = name
        self._num_layers = num_layers
        self._max_context = max_context
        self.layer_seconds = layer_seconds
        self._loaded: set[int] = set()
        #: the worker's own layer heat (decay and all): a pass runs every layer, so each pass touches all
        self._heat = LayerHeat(num_layers)
        self._lock = threading.Lock()
        self.core_loaded = False
        self.load_order: list[int] = []
        self.prefix_loaded: list[tuple[int, ...]] = []

    @property
    def model_name(self) -> str:
        return self._name

    @property
    def model_digest(self) -> str:
        return "sha256:" + hashlib.sha256(f"{self._name}/{self._num_layers}".encode()).hexdigest()

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def device(self) -> str:
        return "cpu"

    def layers_resident(self) -> int:
        with self._lock:
            return len(self._loaded)

    def _load(self, index: int) -> bool:
        with self._lock:
            if index in self._loaded:
                return False
        time.sleep(self.layer_seconds)
        with self._lock:
            self._loaded.add(index)
            self.load_order.append(index)
        return True

    def load_layers(self, order: Sequence[int], progress: LayerProgress | None = None) -> None:
        self.core_loaded = True
        for index in order:
            if not 0 <= index < self._num_layers:
                raise ValueError(f"layer {index} out of range")
            if self._load(index) and progress is not None:
                progress(self.layers_resident(), self._num_layers, index)

    def layer_heat(self) -> dict[int, float]:
        return self._heat.snapshot()

    def _touch_all(self) -> None:
        self.core_loaded = True
        for index in range(self._num_layers):
            self._load(index)  # lazy load on first use: a forward never sees a missing layer
        self._heat.touch_all()

    def encode(self, text: str) -> list[int]:
        return [2 + zlib.crc32(word.encode()) % (VOCAB - 2) for word in _WORD.findall(text)]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(f" w{token}" if token != EOS else "" for token in token_ids)

    def _check(self, token_ids: Sequence[int], extra: int = 0) -> None:
        if not token_ids:
            raise RequestError("prompt is empty")
        if len(token_ids) + extra > self._max_context:
            raise RequestError(
                f"prompt of {len(token_ids)} tokens + {extra} to generate exceeds "
                f"the context of {self._max_context}"
            )
        if any(not 0 <= t < VOCAB for t in token_ids):
            raise RequestError(f"token ids must be within 0..{VOCAB - 1}")

    def prefill(self, token_ids: Sequence[int]) -> None:
        self._check(token_ids)
        self._touch_all()

    def generate(
        self, token_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0
    ) -> Iterator[GenerationStep]:
        self._check(token_ids, max_new_tokens)
        if max_new_tokens < 1:
            raise RequestError("max_new_tokens must be >= 1")
        self._touch_all()
        rng = random.Random(sum(token_ids))
        context = list(token_ids)
        for produced in range(1, max_new_tokens + 1):
            self._touch_all()
            if temperature > 0:
                token = rng.randrange(2, VOCAB)
            else:
                token = (sum(context[-3:]) * 31 + 7) % VOCAB
                token = max(token, 2)
            context.append(token)
            last = produced == max_new_tokens
            yield GenerationStep(token, f" w{token}", last, "length" if last else None)

    def save_prefix_kv(self, token_ids: Sequence[int], path: Path) -> None:
        path.write_text(json.dumps({"digest": self.model_digest, "tokens": list(token_ids)}))

    def load_prefix_kv(self, token_ids: Sequence[int], path: Path) -> bool:
        try:
            body = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ModelLoadError(f"{path}: unusable prefix file: {error}") from None
        if body.get("digest") != self.model_digest or body.get("tokens") != list(token_ids):
            return False
        self.prefix_loaded.append(tuple(token_ids))
        return True

