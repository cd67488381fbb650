"""What the worker is doing, as the start-up sequence writes it and the HTTP handlers read it.

`WarmupStatus` is the part both modes publish on /readyz (stage, plan, tier, progress);
`WorkerStatus` adds the built-in engine's own state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from warmpool_worker.engine_api import Engine
from warmpool_worker.warmup import WarmupPlan, WarmupProgress

from warmpool.contract.api import Tier
from warmpool.contract.http import STAGE_READY, STAGE_STARTING


@dataclass
class WarmupStatus:
    """The warm-up state the built-in worker and the sidecar both publish on /readyz."""

    stage: str = STAGE_STARTING
    error: str | None = None
    plan: WarmupPlan | None = None
    warmup_tier: Tier | None = None
    progress: WarmupProgress = field(default_factory=WarmupProgress)

    def describe_warmup(self) -> dict[str, Any]:
        """The ``warmup`` part of the /readyz body: the plan, the tier it ran at, its progress."""
        return {
            "plan": None if self.plan is None else self.plan.describe(),
            "tier": None if self.warmup_tier is None else self.warmup_tier.value,
            **self.progress.describe(),
        }


@dataclass
class WorkerStatus(WarmupStatus):
    """What the worker is doing; written by the start-up sequence, read by the handlers."""

    model_name: str = field(kw_only=True)
    engine: Engine | None = None
    started_at: float = field(default_factory=time.time)
    #: Set for good once a request met NaN/Inf logits (sticky: a stage written later by the
    #: start-up sequence cannot make the worker ready again).
    unhealthy: bool = False

    @property
    def ready(self) -> bool:
        return self.stage == STAGE_READY and self.engine is not None and not self.unhealthy
