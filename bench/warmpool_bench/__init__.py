"""warmpool benchmarks: cold start side by side with the baselines, and the operator at scale.

Run as `warmpool bench coldstart ...` and `warmpool bench scale ...` (see bench/README.md).
"""
