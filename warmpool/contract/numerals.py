"""Numbers another party writes as text (an annotation, a label, a header, an environment variable,
a metric's label): one strict grammar, read the same way by every part of warmpool.

Python's own parsers are generous with a stranger's text: ``str.isdigit()`` is true of "²" (which
``int()`` then refuses with a ValueError nobody expected), ``int()`` takes Arabic-Indic and
fullwidth digits, "+1", " 1 " and "1_000", refuses more than 4,300 digits, and ``float()`` takes
"nan", "inf" and "1e999".  Here an integer is 1 to ``MAX_INTEGER_DIGITS`` ASCII digits within the
caller's bounds, and a decimal is plain ASCII notation with a finite value.  Anything else raises
:class:`NumeralError` (a ValueError), whose message says what is wrong.

Part of the contract: names both sides must agree on, each defined once (see warmpool/contract/__init__.py).
``re`` and ``math`` are on the worker's start path already (the standard library's own imports)."""

from __future__ import annotations

import math
import re

#: Digits an integer may have: a signed 64-bit integer's, so that no caller's bound is ever beaten
#: by the length alone and ``int()`` never sees a long string.
MAX_INTEGER_DIGITS = 19
#: Characters of a decimal's text: more than any finite double needs in plain notation.
MAX_DECIMAL_CHARS = 64
#: How the Prometheus text format writes an unbounded histogram bucket's ``le``.
PROMETHEUS_INF = "+Inf"
#: The most of a refused text a message repeats (a stranger's text; room for a held value with its trace).
_SHOWN_CHARS = 100

_INTEGER = re.compile(r"[0-9]+", re.ASCII)
_DECIMAL = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)


class NumeralError(ValueError):
    """Text that is not a number in the strict grammar, or one out of its bounds (the message says which)."""


def shown(text: object) -> str:
    """A stranger's text as a message repeats it: quoted, escaped, cut short."""
    quoted = ascii(text)
    return quoted if len(quoted) <= _SHOWN_CHARS else quoted[:_SHOWN_CHARS] + "..."


def parse_ascii_int(text: object, maximum: int, minimum: int = 0) -> int:
    """An integer written as ASCII digits only (no sign, space, separator or other script's
    digits), within ``[minimum, maximum]``; raises :class:`NumeralError` otherwise."""
    if not isinstance(text, str) or _INTEGER.fullmatch(text) is None:
        raise NumeralError(f"{shown(text)} is not a whole number in ASCII digits")
    if len(text) > MAX_INTEGER_DIGITS:
        raise NumeralError(f"{shown(text)} has more than {MAX_INTEGER_DIGITS} digits")
    number = int(text)
    if not minimum <= number <= maximum:
        raise NumeralError(f"{number} is outside [{minimum}, {maximum}]")
    return number


def ascii_int_or_none(text: object, maximum: int, minimum: int = 0) -> int | None:
    """:func:`parse_ascii_int`, or None where the caller only ignores what is not one."""
    try:
        return parse_ascii_int(text, maximum, minimum)
    except NumeralError:
        return None


def parse_ascii_decimal(text: object, minimum: float = -math.inf, maximum: float = math.inf) -> float:
    """A finite number in plain ASCII notation ("-1", "0.5", "1e+06"; never "nan", "inf", "+1",
    " 1" or "1_0"), within ``[minimum, maximum]``; raises :class:`NumeralError` otherwise."""
    if not isinstance(text, str) or len(text) > MAX_DECIMAL_CHARS or _DECIMAL.fullmatch(text) is None:
        raise NumeralError(f"{shown(text)} is not a number in plain ASCII notation")
    number = float(text)
    if not math.isfinite(number):
        raise NumeralError(f"{shown(text)} is not finite")
    if not minimum <= number <= maximum:
        raise NumeralError(f"{number:g} is outside [{minimum:g}, {maximum:g}]")
    return number


def bucket_bound(text: object) -> float | None:
    """A Prometheus histogram bucket's ``le`` label: PROMETHEUS_INF, or a non-negative plain decimal;
    None for anything else ("nan", "inf", "1_0", other scripts' digits)."""
    if text == PROMETHEUS_INF:
        return math.inf
    try:
        return parse_ascii_decimal(text, minimum=0.0)
    except NumeralError:
        return None
