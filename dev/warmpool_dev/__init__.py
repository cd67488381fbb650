"""warmpool_dev: what the developer tools share -- never shipped in an image.

The demo (`warmpool demo`), the model fetch (`warmpool model fetch`), the benchmarks and
the tests use it: tiny random-weight checkpoints, the small real test model, the
cold-start timeline.  The `warmpool` command imports it only inside those subcommands.
"""
