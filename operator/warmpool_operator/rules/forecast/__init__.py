"""Demand prediction for a WarmModel's pool (pure: no Kubernetes, no I/O, no threads).

The operator feeds each WarmModel's request history in at every pass and acts on what comes
out (control/forecasting.py); ``warmpool bench predict`` drives the very same code over a real
trace.  One module per job:

- :mod:`.lengths`: the graph-friendly token lengths that bin prompt/generated lengths.
- :mod:`.history`: per-WarmModel history at two resolutions (fine steps, and a coarse tier rolled
  up from them and kept for weeks), bounded, with a compact versioned serialisation for a ConfigMap
  value and a parser that refuses garbage.
- :mod:`.history_reshape`: a history's newest part, or re-held at other limits (an upgrade's).
- :mod:`.steps`: history steps from the workers' cumulative counters, and the measured capacity.
- :mod:`.features`: lagged rates and rolling statistics over a 15-step window; the daily and weekly
  parts from the coarse tier.
- :mod:`.baselines`: last value, seasonal naive, EWMA (with empirical quantile bands).
- :mod:`.quantile_model`: LightGBM quantile regression (p50, p90) on one thread, bounded.
- :mod:`.evaluation`: pinball loss and the online scoreboard of recent forecasts.
- :mod:`.forecaster`: candidates, periodic retraining, and the best recent performer.
- :mod:`.decision`: desired warm pods from the forecast, the measured capacity and lead time.
- :mod:`.buckets`: warm-up lengths learned from the prompt-length histogram.
- :mod:`.report`: what status says of it (status.forecast, the Predictive condition).

The history is kept in a ConfigMap by io/history_store.py, loaded back when the operator starts.
"""
