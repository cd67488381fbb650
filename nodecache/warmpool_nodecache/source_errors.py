"""The errors every fill source raises (one module, so the HTTP client, the address guard and the
sources share them without importing each other)."""

from __future__ import annotations


class SourceError(RuntimeError):
    """A source that cannot deliver what was asked; the message names the URL and why."""


class SourceMissingError(SourceError):
    """The source says the object does not exist (HTTP 404)."""


class SourceLimitError(SourceError):
    """An answer larger than the limit the reader set, or slower than its deadline."""
