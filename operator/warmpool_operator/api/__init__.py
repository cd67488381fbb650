"""What users write: the WarmModel API as typed models, its validation rules, and the CRD
generated from them.  Imports nothing else of the operator."""
