"""Log line formats of `warmpool worker ...` and `warmpool operator` (``--log-format``).

``text`` is the classic one line per record; ``json`` is one JSON object per line with
``time``, ``level``, ``logger``, ``message`` (and ``exc_info`` when there is one), plus
``trace_id``/``span_id`` (hex, as in Jaeger's UI) while an OpenTelemetry span is active.

The span is looked up only if ``opentelemetry`` is already imported (tracing is on): the
formatter never imports it, so a worker with tracing off pays nothing for JSON logs.
Standard library only (no json-logger dependency in the images).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import UTC, datetime

from warmpool.contract.telemetry import LOG_FORMAT_JSON, LOG_FORMAT_TEXT, LOG_FORMATS, LOG_LEVELS

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def active_span_ids() -> tuple[str, str] | None:
    """(trace_id, span_id) of the current span in hex, or None (none active, or tracing off)."""
    if "opentelemetry.trace" not in sys.modules:
        return None
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


class JsonFormatter(logging.Formatter):
    """One JSON object per record; see the module docstring for the keys."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ids = active_span_ids()
        if ids is not None:
            line["trace_id"], line["span_id"] = ids
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def add_log_level_flag(parser: argparse._ActionsContainer) -> None:
    """``--log-level``, the same on every command: one of LOG_LEVELS, any case; anything else is a
    usage error naming the choices (a typo once ran silently at INFO)."""
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO",
                        help=f"{' | '.join(LOG_LEVELS)} (default: %(default)s)")


def configure_logging(level_name: str, log_format: str) -> None:
    """The root logger at ``level_name`` (unknown names: INFO), lines in ``log_format``."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {list(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == LOG_FORMAT_JSON else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=getattr(logging, str(level_name).upper(), logging.INFO), handlers=[handler])


__all__ = ["LOG_FORMAT_JSON", "LOG_FORMAT_TEXT", "JsonFormatter", "active_span_ids", "add_log_level_flag",
           "configure_logging"]
