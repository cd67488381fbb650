"""The strict grammar of numbers another part writes as text (warmpool/contract/numerals.py): ASCII
digits only, within bounds, finite; everything else a NumeralError saying what is wrong."""

from __future__ import annotations

import math

import pytest

from warmpool.contract.numerals import (
    MAX_INTEGER_DIGITS,
    NumeralError,
    ascii_int_or_none,
    bucket_bound,
    parse_ascii_decimal,
    parse_ascii_int,
    shown,
)

pytestmark = pytest.mark.unit

#: Text Python's own parsers take (or str.isdigit() vouches for) that is not a plain ASCII number.
NOT_ASCII_INTEGERS = [
    "\u00b2",  # superscript two: isdigit() is True, int() raises
    "\u0663",  # Arabic-Indic three: int() gives 3
    "\u06f3",  # extended Arabic-Indic three
    "\uff13",  # fullwidth three
    "\u0967",  # Devanagari one
    "1\u00b2",
    "+1", "-1", " 1", "1 ", "1\n", "1_000", "1e3", "1.0", "0x10", "nan", "inf", "", "one",
]


@pytest.mark.parametrize("text", NOT_ASCII_INTEGERS)
def test_only_ascii_digits_are_an_integer(text: str) -> None:
    with pytest.raises(NumeralError, match="not a whole number in ASCII digits"):
        parse_ascii_int(text, maximum=10**6)
    assert ascii_int_or_none(text, maximum=10**6) is None


@pytest.mark.parametrize("value", [None, 7, 7.0, b"7", ["7"]])
def test_an_integer_is_read_from_text_only(value: object) -> None:
    with pytest.raises(NumeralError):
        parse_ascii_int(value, maximum=10)


def test_integers_in_their_bounds_are_read() -> None:
    assert parse_ascii_int("0", maximum=5) == 0
    assert parse_ascii_int("007", maximum=7) == 7
    assert parse_ascii_int("5", maximum=5, minimum=5) == 5


@pytest.mark.parametrize(("text", "maximum", "minimum", "message"), [
    ("6", 5, 0, r"6 is outside \[0, 5\]"),
    ("0", 5, 1, r"0 is outside \[1, 5\]"),
    ("9" * (MAX_INTEGER_DIGITS + 1), 10**30, 0, "has more than 19 digits"),
    ("9" * 5000, 10**30, 0, "has more than 19 digits"),  # int() would refuse past 4,300 digits itself
])
def test_an_integer_out_of_bounds_says_so(text: str, maximum: int, minimum: int, message: str) -> None:
    with pytest.raises(NumeralError, match=message):
        parse_ascii_int(text, maximum=maximum, minimum=minimum)


@pytest.mark.parametrize(("text", "number"), [("0", 0.0), ("-1", -1.0), ("0.5", 0.5), ("1.", 1.0), (".5", 0.5),
                                              ("1e+06", 1e6), ("2.5E-3", 0.0025), ("-0", 0.0)])
def test_plain_decimals_are_read(text: str, number: float) -> None:
    assert parse_ascii_decimal(text) == number


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "+Inf", "-inf", "Infinity", "+1", " 1", "1 ", "1_0",
                                  "\u0663", "\uff11.5", "1.5\u00b2", "", ".", "-", "e5", "1e", "0x1p3", "1" * 65])
def test_anything_else_is_not_a_decimal(text: str) -> None:
    with pytest.raises(NumeralError, match="not a number in plain ASCII notation"):
        parse_ascii_decimal(text)


def test_a_decimal_must_be_finite_and_in_bounds() -> None:
    with pytest.raises(NumeralError, match="not finite"):
        parse_ascii_decimal("1e999")
    with pytest.raises(NumeralError, match="not finite"):
        parse_ascii_decimal("9" * 60 + "e300")
    with pytest.raises(NumeralError, match=r"outside \[0, 1\]"):
        parse_ascii_decimal("1.5", minimum=0.0, maximum=1.0)


def test_a_message_repeats_a_strangers_text_escaped_and_short() -> None:
    assert shown("\u00b2") == "'\\xb2'"
    assert shown("x" * 1000).endswith("...") and len(shown("x" * 1000)) < 110
    assert "\n" not in shown("1\n2")


def test_a_histogram_bound_is_plus_inf_or_a_plain_non_negative_decimal() -> None:
    assert [bucket_bound(text) for text in ("+Inf", "0.5", "1e+06", "0")] == [math.inf, 0.5, 1e6, 0.0]
    assert [bucket_bound(text) for text in ("inf", "Inf", "nan", "-1", "\u0663", "1_0", " 1", None)] == [None] * 8
