"""What every reconciler of the operator shares, made once at start-up (app/handlers.py) and
handed to each one by the registry: the clients, the one scrape scheduler, the cross-pool
pressure board, the activator's addresses, the one forecasting thread, the settings, tracing,
the clocks and the control key.

The clocks are injected so that a unit test drives time itself (the pass never reads
``time`` behind its back): ``monotonic`` for every interval, ``wall`` for status timestamps
and demand history steps.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from warmpool_operator.control.sleep_actions import PressureBoard
from warmpool_operator.control.zero import ActivatorBoard
from warmpool_operator.io.kube import Kube
from warmpool_operator.io.scrape_scheduler import ScrapeScheduler
from warmpool_operator.io.tracing import Tracing
from warmpool_operator.io.worker_client import WorkerClient
from warmpool_operator.rules.control_token import KEY_BYTES
from warmpool_operator.rules.node_answers import NodeAnswers
from warmpool_operator.rules.node_health import NodeBoard
from warmpool_operator.settings import OperatorConfig


@dataclass(frozen=True)
class Shared:
    kube: Kube
    workers: WorkerClient
    scheduler: ScrapeScheduler
    config: OperatorConfig = field(default_factory=OperatorConfig)
    tracing: Tracing = field(default_factory=Tracing)
    #: every pool's sleepable pods by node: memory pressure puts the idlest to sleep, whichever pool
    board: PressureBoard = field(default_factory=PressureBoard)
    #: the operator's one forecasting thread (prediction costs at most one core, never the event
    #: loop); None: no demand prediction
    forecasting: Executor | None = None
    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    #: the key every worker's control token derives from (io/control_key.py); a unit test's own
    #: random one unless given
    control_key: bytes = field(default_factory=lambda: secrets.token_bytes(KEY_BYTES))
    #: the activator's addresses, which the Services of scale-to-zero pools at zero list
    activators: ActivatorBoard = field(default_factory=ActivatorBoard)
    #: which nodes are lost or cordoned, from the Node watch (control/nodes.py)
    nodes: NodeBoard = field(default_factory=NodeBoard)
    #: every scraped pod's latest outcome by node: which nodes stopped answering (rules/node_answers.py)
    answers: NodeAnswers = field(default_factory=NodeAnswers)
