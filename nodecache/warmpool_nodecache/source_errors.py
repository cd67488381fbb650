"""The errors every fill source raises (one module, so the HTTP client, the address guard and the
sources share them without importing each other), and the one text a WarmModel's status says of
any of them.

A WarmModel's author reads its status and Events; the node agent reads the source from inside
the cluster.  Were "refused: a cluster range", "no connection", "HTTP 404" and "HTTP 403" told
apart there, a URL pointed at an internal address would tell its author which addresses answer
and on which ports (a port scan run by the agent).  So the status says :func:`unavailable_text`
of every source that was refused, could not be reached or answered with an error, and the
agent's own log -- read by whoever runs the node -- keeps what happened.
"""

from __future__ import annotations


class SourceError(RuntimeError):
    """A source that cannot deliver what was asked; the message names the URL and why."""


class SourceMissingError(SourceError):
    """The source says the object does not exist (HTTP 404)."""


class SourceLimitError(SourceError):
    """An answer larger than the limit the reader set, or slower than its deadline."""


#: The start of what a status says of any source that failed (see the module docstring).
SOURCE_UNAVAILABLE = "model source unavailable"


def unavailable_text(where: str) -> str:
    """What a WarmModel's status and Events say of its source ``where`` (its URL as written,
    ``Source.describe()``) whatever went wrong reading it: the same words for an address the
    agent refused, one that did not answer, and any error answer."""
    return (f"{SOURCE_UNAVAILABLE}: {where} (refused, unreachable or answering with an error; "
            "the node agent's log on this node says which)")
