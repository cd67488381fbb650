"""The node-local model cache: content-addressed blocks, revision manifests, leases, fills, eviction.

A product package of its own (the node agent carries it; the worker image need not), on the
standard library alone besides the shared ``warmpool`` core.
"""
