"""The operator's settings: one typed, frozen object, built once from the command line
(app/cli.py), handed to kopf in its ``memo`` and from there to the registry and every reconciler.

Nothing reads settings from module state: a function that needs one gets it as an argument,
so a test builds the object it wants and no test can leak settings into another.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from warmpool.contract.api import DEFAULT_DIRECTIVE_TTL_SECONDS, MAX_DIRECTIVE_TTL_SECONDS
from warmpool.contract.files import DEFAULT_BLOCK_CACHE_ROOT
from warmpool.kube import DEFAULT_MAX_IN_FLIGHT
from warmpool_operator.model import DEFAULT_WORKER_IMAGE
from warmpool_operator.rules.forecast.timescale import ALLOWED_STEPS_S
from warmpool_operator.rules.host_paths import DEFAULT_ALLOWED_HOST_PATHS
from warmpool_operator.rules.node_leases import DEFAULT_GRACE_S as DEFAULT_NODE_LEASE_GRACE_S

#: Default seconds between scrapes of a WarmModel's worker pods.
DEFAULT_SCRAPE_INTERVAL_SECONDS = 10.0
#: Scrapes a demand step should see: a step with none is stored as missing, not as zero demand.
SCRAPES_PER_STEP = 3


def default_predict_step(scrape_interval: float) -> int:
    """Demand prediction's history step when none is given: the shortest the counters support, i.e.
    the shortest forecast step (``timescale.ALLOWED_STEPS_S``, then the longer divisors of an hour)
    that sees :data:`SCRAPES_PER_STEP` scrapes.  30 s at the default 10 s scrape; 10 s at 3 s or less
    (a 10 s step over 10 s scrapes holds steps that saw no scrape: missing, not zero)."""
    if scrape_interval <= 0:
        raise ValueError(f"the scrape interval must be > 0 s, got {scrape_interval}")
    longer = (d for d in range(ALLOWED_STEPS_S[-1] + 1, 3601) if 3600 % d == 0)
    return next(s for s in (*ALLOWED_STEPS_S, *longer) if s >= SCRAPES_PER_STEP * scrape_interval or s == 3600)


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class OperatorConfig:
    #: Seconds between scrape rounds of every WarmModel's worker pods (and passes on their samples).
    scrape_interval: float = DEFAULT_SCRAPE_INTERVAL_SECONDS
    #: Seconds a scrape of one pod may take (connect + read), and pods scraped at once.
    scrape_timeout: float = 3.0
    scrape_concurrency: int = 16
    #: API requests the operator's client has in flight at once (warmpool/kube.py); watches apart.
    api_concurrency: int = DEFAULT_MAX_IN_FLIGHT
    #: Only pod IPs inside these networks are dialled (empty: any).  Tests pass 127.0.0.0/8
    #: so that nothing but loopback is ever contacted.
    scrape_networks: tuple[IPNetwork, ...] = ()
    #: Least seconds between two writes of a WarmModel's heat map into its ConfigMap.
    heat_write_interval: float = 60.0
    #: How long a tier directive holds in a worker if the operator stops re-sending it.
    directive_ttl: float = DEFAULT_DIRECTIVE_TTL_SECONDS
    #: Seconds before a WarmModel that failed for good (a child refused with 400/422) is tried
    #: again without a spec change, so that an outside fix (a policy relaxed, a name freed) heals it.
    permanent_retry_interval: float = 300.0
    #: Demand prediction's fine history step (it must divide an hour: the length histograms are kept
    #: per hour): by default the shortest the scrapes support (:func:`default_predict_step`), 30 s at
    #: the default scrape interval.  The coarse tier beside it (control/forecasting.py) keeps weeks.
    predict_step_seconds: int = default_predict_step(DEFAULT_SCRAPE_INTERVAL_SECONDS)
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
    #: Seconds between resyncs (control/resync.py), the backstop for deletions no watch reported;
    #: a watch seen listing again asks for one at once.
    resync_interval: float = 600.0
    #: A node whose kubelet renewed no Lease for this long, while another node's did, is lost
    #: (rules/node_leases.py); 0 leaves node loss to the Ready condition alone.
    node_lease_grace_seconds: float = DEFAULT_NODE_LEASE_GRACE_S
    #: Seconds between knocks on one worker pod per node (control/node_probe.py): a dead machine is
    #: judged within a few of them rather than a scrape round; 0 leaves it to the scrapes.
    node_probe_interval: float = 1.0
    #: Cluster-wide mode: the ingress rules of a NetworkPolicy the operator makes over each pool's
    #: worker pods, in the pool's namespace (the chart renders them as it does its own namespaced
    #: worker policies, and passes them as --worker-policy-ingress).  None: no such policy.
    worker_policy_ingress: tuple[Mapping[str, Any], ...] | None = None
    #: The node agents' block cache root on every node (an http/s3 source's pods mount its revisions/).
    block_cache_root: str = DEFAULT_BLOCK_CACHE_ROOT
    #: The worker image of pods whose WarmModel names none (spec.pod.image).
    worker_image: str = DEFAULT_WORKER_IMAGE
    #: The Secret holding the key the workers' control tokens derive from (io/control_key.py).
    control_key_namespace: str = "default"
    control_key_secret: str = "warmpool-control-key"
    #: The activator's Service (namespace, name), whose EndpointSlices give the addresses the
    #: Services of scale-to-zero pools at zero route to; None: no activator (such pools then have
    #: no endpoint while at zero, and the operator warns).
    activator_service: tuple[str, str] | None = None
    #: Seconds before a pass that failed for a passing reason (a conflict, an API hiccup) is retried.
    retry_delay: float = 3.0

    def allowed(self, ip: str) -> bool:
        """Whether a pod IP may be dialled (it lies in a --scrape-network, or none was given)."""
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            return False
        return not self.scrape_networks or any(address in net for net in self.scrape_networks)

    def ttl(self) -> float:
        """A directive's TTL: long enough to survive a few missed rounds, bounded by what the worker accepts."""
        return min(MAX_DIRECTIVE_TTL_SECONDS, max(self.directive_ttl, 6 * self.scrape_interval))
