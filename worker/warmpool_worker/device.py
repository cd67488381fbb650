"""Which device the worker runs on: the spellings ``--device`` accepts, and what ``auto`` means.

Its own module so the command line (which checks the spelling) and the start-up sequence
(which resolves ``auto``) share it without importing each other.  torch is imported only when
``auto`` has to be resolved, never at import, and always through `import_torch`.
"""

from __future__ import annotations

import os
import re
import sys
from types import ModuleType
from typing import Any

#: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
DEVICE_SPELLING = re.compile(r"auto|cpu|cuda(:[0-9]+)?")

#: At import torch reads every installed distribution's entry points for out-of-tree device
#: backends (measured ~40 ms of its ~1.5 s import with this project's environment).  The worker
#: runs on cpu or cuda only, both built into torch, so it turns the scan off unless told otherwise.
TORCH_BACKEND_AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"


def import_torch() -> ModuleType:
    """``import torch``, without the device-backend scan unless the environment asks for it."""
    os.environ.setdefault(TORCH_BACKEND_AUTOLOAD_ENV, "0")
    import torch

    return torch


def valid_device(device: str) -> bool:
    return DEVICE_SPELLING.fullmatch(device) is not None


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; anything else as given."""
    if device != "auto":
        return device
    torch: Any = sys.modules.get("torch")
    if torch is None:
        try:
            torch = import_torch()
        except ImportError:
            return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"
