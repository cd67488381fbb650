"""The reconcile pass and what it drives: one reconciler per WarmModel, the registry of them,
child management, sleep and wake actions, demand forecasting at run time, and the resync."""
