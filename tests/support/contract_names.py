"""Every name of the contract (warmpool/contract/), for tests that check that a manifest, a
dashboard or a runbook uses only names the code defines."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any

import warmpool.contract


def contract_modules() -> list[ModuleType]:
    """The contract's topic modules (api, pods, http, metrics, files, nodecache)."""
    return [importlib.import_module(f"warmpool.contract.{info.name}")
            for info in pkgutil.iter_modules(warmpool.contract.__path__)]


def contract_values() -> dict[str, Any]:
    """Every public name of the contract and its value."""
    return {name: value for module in contract_modules() for name, value in vars(module).items()
            if not name.startswith("_") and name.isupper()}
