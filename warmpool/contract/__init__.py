"""The one place that owns every name two parts of warmpool must agree on: the operator, the node
agent and the worker, and what users and the chart read of them (metric, span and label names,
annotation keys, HTTP paths, the API's identity).

They live here and nowhere else, one module per topic; each name is defined once, and importing
any of them costs nothing on the worker's start path (the standard library only).  A name only
one side uses lives on that side (the API's own defaults in the operator's api/types.py, the
vLLM metric names the sidecar reads in warmpool_worker.engine_signals, and so on):

* ``api``: the WarmModel API: identity, status conditions, defaults and bounds, tiers;
* ``pods``: the WarmModel's children and their pods: names, containers, labels, annotations,
  environment variables;
* ``http``: the worker's HTTP surface: paths, ports, the control body, /readyz stages;
* ``metrics``: metric names (worker, sidecar, external engines, operator) and label names;
* ``files``: ConfigMap keys, file formats, token length bins, mount paths in worker pods;
* ``telemetry``: OpenTelemetry's variables, service, span and attribute names, log formats;
* ``nodecache``: what the node agent, the operator and worker pods agree on about the node cache;
* ``numerals``: the strict grammar of numbers another part writes as text (ASCII digits, finite);
* ``zero``: scale to zero: the activator's held-requests annotation, port and the Service's EndpointSlices.

Import a name from its topic (``from warmpool.contract.http import PATH_READYZ``); this package
re-exports nothing.
"""
