"""The edge: the command line, kopf's registration of handlers, and leader election."""
