"""A model's ``tokenizer.json``, read now or in a thread of its own while torch imports.

Parsing SmolLM2's 3.5 MB tokenizer.json takes ~85 ms on this project's 2-core machine, and
``tokenizers`` parses in Rust with the GIL released: started before ``import torch`` (about
1.5 s, nearly all of it holding the GIL), the parse runs on the other core and leaves the
path to usable weights. torch-free on purpose, so the worker can start it before torch.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from warmpool_worker.checkpoint import TOKENIZER_FILE
from warmpool_worker.engine_api import ModelLoadError

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def read_tokenizer(model_dir: Path) -> Tokenizer:
    """The directory's tokenizer.json, parsed; a ModelLoadError naming the file if it is missing or bad."""
    path = model_dir / TOKENIZER_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: file is missing (the engine reads tokenizer.json)")
    from tokenizers import Tokenizer  # on the load path only

    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception on bad files
        raise ModelLoadError(f"{path}: cannot parse tokenizer: {error}") from None


class TokenizerRead:
    """`read_tokenizer` begun in a daemon thread; `result` waits for it and raises what it raised.

    Nothing is reported until `result`: the engine's loader asks for the tokenizer after it
    validated the checkpoint, so a bad checkpoint is still the error a start reports first.
    """

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._tokenizer: Tokenizer | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, name="tokenizer-read", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            self._tokenizer = read_tokenizer(self.model_dir)
        except BaseException as error:  # handed to whoever asks for the result, in its thread
            self._error = error

    def result(self) -> Tokenizer:
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._tokenizer is None:  # unreachable: the thread sets one or the other
            raise ModelLoadError(f"{self.model_dir}: the tokenizer read ended without a result")
        return self._tokenizer
