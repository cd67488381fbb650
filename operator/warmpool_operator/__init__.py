"""The warmpool operator: turns WarmModel objects into warm pools of inference workers.

The WarmModel API (typed models, parsing) lives in :mod:`warmpool_operator.api.types`; the CRD
is generated from it by :mod:`warmpool_operator.api.crdgen`.
"""
