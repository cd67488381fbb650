"""warmpool: keep pools of LLM inference workers warm on Kubernetes."""

__version__ = "0.1.0"
