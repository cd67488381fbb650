"""The operator's run-time configuration and kopf's settings, in one ``@kopf.on.startup``.

``CONFIG`` is filled by the command line (cli.py) *before* the handlers module is imported,
because kopf reads a timer's interval when the decorator runs.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, field
from typing import Any

import kopf

from warmpool import contract
from warmpool_operator.host_paths import DEFAULT_ALLOWED_HOST_PATHS

#: Explicit retry policy of every handler (kopf's default is to retry forever, every 60 s).
HANDLER_RETRIES = 20
HANDLER_BACKOFF = 5.0
HANDLER_TIMEOUT = 300.0
#: The temporary-error delay for conflicts and API hiccups.
RETRY_DELAY = 3.0
#: Demand prediction's history resolution, the reference design's 60 s.
DEFAULT_PREDICT_STEP_SECONDS = 60


@dataclass
class OperatorConfig:
    scrape_interval: float = contract.DEFAULT_SCRAPE_INTERVAL_SECONDS
    #: Seconds a scrape of one pod may take (connect + read), and pods scraped at once.
    scrape_timeout: float = 3.0
    scrape_concurrency: int = 16
    #: Only pod IPs inside these networks are dialled (empty: any).  Tests pass 127.0.0.0/8
    #: so that nothing but loopback is ever contacted.
    scrape_networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = field(default_factory=list)
    #: Least seconds between two writes of a WarmModel's heat map into its ConfigMap.
    heat_write_interval: float = 60.0
    #: How long a tier directive holds in a worker if the operator stops re-sending it.
    directive_ttl: float = contract.DEFAULT_DIRECTIVE_TTL_SECONDS
    #: Seconds before a WarmModel that failed for good (a child refused with 400/422) is tried
    #: again without a spec change, so that an outside fix (a policy relaxed, a name freed) heals it.
    permanent_retry_interval: float = 300.0
    #: Demand prediction's history step (#16): 60 s; shorter only for tests and demos (it must divide
    #: an hour: the length histograms are kept per hour).
    predict_step_seconds: int = DEFAULT_PREDICT_STEP_SECONDS
    #: Node directories (normalised prefixes) a WarmModel's hostPath or nodeCache may lie under.
    allowed_host_paths: tuple[str, ...] = DEFAULT_ALLOWED_HOST_PATHS
    #: The API server ends each watch after this many seconds (kopf then starts the next one).
    #: Whole seconds: it is sent as timeoutSeconds, and "10.0" is a 400 from the API server.
    watch_server_timeout: int = 120
    #: A watch that carries nothing for this long -- not even the bookmark the API server sends
    #: each minute -- is taken for stalled (a dropped NAT entry, a hung proxy: the server's end of
    #: the watch never arrives either) and dialled again.  Without it the operator would wait on a
    #: stalled watch until the client's total bound, blind to every event meanwhile.
    watch_inactivity_timeout: float = 70.0
    #: Seconds between resyncs (resync.py), the backstop for deletions no watch reported; a watch
    #: seen listing again asks for one at once.
    resync_interval: float = 600.0
    #: The node agents' block cache root on every node (an http/s3 source's pods mount its revisions/).
    block_cache_root: str = contract.DEFAULT_BLOCK_CACHE_ROOT

    def allowed(self, ip: str) -> bool:
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            return False
        return not self.scrape_networks or any(address in net for net in self.scrape_networks)

    def ttl(self) -> float:
        """Long enough to survive a few missed ticks, bounded by what the worker accepts."""
        return min(contract.MAX_DIRECTIVE_TTL_SECONDS, max(self.directive_ttl, 6 * self.scrape_interval))


CONFIG = OperatorConfig()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # A strict schema prunes kopf's status.kopf: progress and diff-base go to annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=contract.KOPF_ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=contract.KOPF_ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = contract.OPERATOR_FINALIZER
    # Watches: the server closes a watch after server_timeout, the client gives up a little
    # later; a silent (stalled) one is dialled again after inactivity_timeout.
    settings.watching.server_timeout = CONFIG.watch_server_timeout
    settings.watching.client_timeout = CONFIG.watch_server_timeout + 30
    settings.watching.inactivity_timeout = CONFIG.watch_inactivity_timeout
    settings.watching.connect_timeout = 10
    settings.watching.reconnect_backoff = 1.0
    settings.networking.request_timeout = 30
    settings.networking.connect_timeout = 10
    # Events: ours (tier transitions, errors) and kopf's own at INFO and above.
    settings.posting.enabled = True
    settings.posting.level = logging.INFO
    settings.posting.reporting_component = contract.MANAGED_BY
    # Queueing ("batching" of events per object): bursts are handled once, idle object
    # workers go away, and a stuck watch-stream error backs off instead of spinning.
    # No cap on object workers: an idle worker lingers idle_timeout after its last event and
    # holds its slot, so a cap of 64 with 60 s let through about one new WarmModel per second
    # (250 created at once took 213 s on a loaded 2-core machine).  Idle workers end after 5 s.
    settings.queueing.worker_limit = None
    settings.queueing.idle_timeout = 5
    settings.queueing.exit_timeout = 10
    settings.queueing.error_delays = (1, 3, 10, 30, 60)
    # A WarmModel deleted while its timer's sync was in flight kept its finalizer until kopf's
    # next poll of the exiting timer, 60 s by default (seen: `kubectl delete wm` timing out at
    # 60 s in the tests). Poll each second: the sync ends within its own bounded timeouts.
    settings.background.cancellation_polling = 1.0
    settings.networking.error_backoffs = (1, 2, 5, 10, 20)
    # Handlers without their own policy: retry after a bounded backoff (each handler also
    # sets retries=/backoff=/timeout= explicitly).
    settings.execution.default_backoff = HANDLER_BACKOFF
    settings.execution.max_workers = 8
    # One replica acts (leader.py's Lease, taken before kopf starts): no kopf peering objects.
    settings.peering.standalone = True
