"""Demand prediction for a WarmModel's pool (pure: no Kubernetes, no I/O, no threads).

The operator (once it is event-driven, issue #14) feeds each WarmModel's request
history in and acts on what comes out; ``warmpool bench predict`` drives the very same
code over a real trace.  One module per job:

- :mod:`.lengths`: the graph-friendly token lengths that bin prompt/generated lengths.
- :mod:`.history`: per-WarmModel history at 60 s resolution, bounded, with a compact
  versioned serialisation for a ConfigMap value and a parser that refuses garbage.
- :mod:`.features`: lagged rates and rolling statistics over a 15-step window.
- :mod:`.baselines`: last value, seasonal naive, EWMA (with empirical quantile bands).
- :mod:`.quantile_model`: LightGBM quantile regression (p50, p90) on one thread, bounded.
- :mod:`.evaluation`: pinball loss and the online scoreboard of recent forecasts.
- :mod:`.forecaster`: candidates, periodic retraining, and the best recent performer.
- :mod:`.decision`: desired warm pods from the forecast, the measured capacity and lead time.
- :mod:`.buckets`: warm-up lengths learned from the prompt-length histogram.

The one exception to "no I/O": :mod:`.store` keeps a WarmModel's history in a ConfigMap it
owns (the Kubernetes client the operator uses), loaded back when the operator starts.
"""
