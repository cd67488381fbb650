"""The one place that owns every name the operator, the node agent and the worker must agree on.

Metric names, label names, tier names, default thresholds, annotation keys, HTTP paths,
environment variables, file formats and mount paths live here and nowhere else, one module
per topic; each name is defined once, and importing any of them costs nothing on the
worker's start path (the standard library only):

* ``api``: the WarmModel API: identity, status conditions, defaults and bounds, tiers;
* ``pods``: the WarmModel's children and their pods: names, containers, labels, annotations,
  environment variables;
* ``http``: the worker's HTTP surface: paths, ports, the control body, /readyz stages;
* ``metrics``: metric names (worker, sidecar, external engines, operator) and label names;
* ``files``: ConfigMap keys, file formats, token length bins, mount paths in worker pods;
* ``nodecache``: what the node agent, the operator and worker pods agree on about the node cache.

Import a name from its topic (``from warmpool.contract.http import PATH_READYZ``); this package
re-exports nothing.
"""
