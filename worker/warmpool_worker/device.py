"""Which device the worker runs on: the spellings ``--device`` accepts, and what ``auto`` means.

Its own module so the command line (which checks the spelling) and the start-up sequence
(which resolves ``auto``) share it without importing each other.  torch is imported only when
``auto`` has to be resolved, never at import.
"""

from __future__ import annotations

import re
import sys
from typing import Any

#: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
DEVICE_SPELLING = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def valid_device(device: str) -> bool:
    return DEVICE_SPELLING.fullmatch(device) is not None


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; anything else as given."""
    if device != "auto":
        return device
    torch: Any = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"
