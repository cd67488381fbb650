"""The body of ``POST /v1/completions``, checked: a 400 (or 404 for another model) naming the
field that is wrong, as an OpenAI-compatible server answers.

Every malformed body is a 400, never a 500: bytes that are not JSON (or not UTF-8, or nested
past Python's recursion limit), and integers of more than `MAX_INTEGER_DIGITS` digits (which
Python refuses to convert past 4,300 digits) become a value that fails its field's check, so
the answer still names the field.  ``NaN`` and ``Infinity`` (which Python's JSON accepts)
fail every number's range check.  ``null`` means the field's default, as in OpenAI's API.

What is served, and the ranges that compute:

* ``prompt``: a non-empty string (valid Unicode), a non-empty list of token ids >= 0, or a
  batch of exactly one of those;
* ``max_tokens``: an integer >= 1 (default 16; the context and ``--max-tokens-limit`` bound
  it later, `check_room`);
* ``temperature``: a finite number within 0..2 (default 1); below 1e-5 the draw is greedy
  (the engine's sampler, ``engine.decoding.GREEDY_BELOW_TEMPERATURE``, says why);
* ``stream``: true or false.

OpenAI's other completion fields are checked for their type and range too, and are refused
(a 400 naming the field) unless at their no-op value, since the built-in engine does not
implement them (`UNSUPPORTED`): a client learns that its request would not be served as it
asked.  Fields unknown to OpenAI's API are ignored, as vLLM does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from warmpool_worker.http_app import BadRequest

DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
MAX_TEMPERATURE = 2.0
#: Integers longer than this (sign aside) are not parsed: no field takes one that large.
MAX_INTEGER_DIGITS = 30
#: How much of a bad value an error message quotes.
SHOWN_CHARS = 80


@dataclass(frozen=True)
class CompletionRequest:
    prompt_ids: list[int] | None
    prompt_text: str | None
    max_tokens: int
    temperature: float
    stream: bool


@dataclass(frozen=True)
class OversizedInteger:
    """A JSON integer too long to parse: it fails every field's check, by name."""

    digits: int

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _integer_or_oversized(text: str) -> int | OversizedInteger:
    digits = len(text.lstrip("-"))
    return OversizedInteger(digits) if digits > MAX_INTEGER_DIGITS else int(text)


def load_body(raw: bytes) -> object:
    """The request body parsed as JSON, or a 400 saying why it is not."""
    try:
        return json.loads(raw, parse_int=_integer_or_oversized)
    except UnicodeDecodeError:
        raise BadRequest(400, "malformed JSON body: not UTF-8") from None
    except json.JSONDecodeError as error:
        raise BadRequest(400, f"malformed JSON body: {error}") from None
    except RecursionError:
        raise BadRequest(400, "malformed JSON body: nested too deeply") from None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_within(low: int, high: float = math.inf) -> Callable[[object], bool]:
    def check(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    return check


def _number_within(low: float, high: float) -> Callable[[object], bool]:
    """Finite (NaN and Infinity fail) and within low..high; booleans are not numbers here."""
    def check(value: object) -> bool:
        return (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
                and low <= value <= high)
    return check


def _bad(name: str, must: str, value: object) -> BadRequest:
    return BadRequest(400, f"{name} must be {must}, got {_shown(value)}", param=name)


@dataclass(frozen=True)
class Unsupported:
    """An OpenAI completion field the built-in engine does not implement."""

    must: str  # what a well-formed value is ("an integer >= 1")
    valid: Callable[[object], bool]
    no_op: Callable[[object], bool]  # the values that ask for nothing beyond what is served
    served: str  # what the engine does instead


def _stop_valid(value: object) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and len(value) <= 4 and all(isinstance(v, str) for v in value)
    )


def _no_usage_chunk(value: object) -> bool:
    return isinstance(value, dict) and not value.get("include_usage", False)


def _never(_value: object) -> bool:
    return False


#: OpenAI's completion fields that are refused unless at their no-op value (module docstring).
UNSUPPORTED: dict[str, Unsupported] = {
    "n": Unsupported("an integer >= 1", _int_within(1), lambda v: v == 1, "one choice per request"),
    "best_of": Unsupported("an integer >= 1", _int_within(1), lambda v: v == 1, "one candidate per request"),
    "echo": Unsupported("true or false", lambda v: isinstance(v, bool), lambda v: v is False,
                        "the completion without the prompt"),
    "logprobs": Unsupported("an integer within 0..5", _int_within(0, 5), _never, "no log probabilities"),
    "suffix": Unsupported("a string", lambda v: isinstance(v, str), lambda v: v == "", "no suffix"),
    "stop": Unsupported("a string or a list of at most 4 strings", _stop_valid, lambda v: v in ("", []),
                        "no stop sequences: generation ends at EOS or max_tokens"),
    "top_p": Unsupported("a number within 0..1", _number_within(0.0, 1.0), lambda v: v == 1,
                         "sampling from the whole distribution, top_p 1"),
    "top_k": Unsupported("an integer >= -1", _int_within(-1), lambda v: v in (-1, 0),
                         "sampling from the whole vocabulary, top_k -1 or 0"),
    "presence_penalty": Unsupported("a number within -2..2", _number_within(-2.0, 2.0), lambda v: v == 0,
                                    "no presence penalty"),
    "frequency_penalty": Unsupported("a number within -2..2", _number_within(-2.0, 2.0), lambda v: v == 0,
                                     "no frequency penalty"),
    "seed": Unsupported("an integer", _is_int, _never, "no per-request seed"),
    "logit_bias": Unsupported("an object", lambda v: isinstance(v, dict), lambda v: v == {}, "no logit bias"),
    "stream_options": Unsupported("an object", lambda v: isinstance(v, dict), _no_usage_chunk,
                                  "no usage chunk in a stream"),
}


def _check_unsupported(body: dict[str, object]) -> None:
    for name, rule in UNSUPPORTED.items():
        value = body.get(name)
        if value is None:
            continue
        if not rule.valid(value):
            raise _bad(name, rule.must, value)
        if not rule.no_op(value):
            raise BadRequest(
                400, f"{name}={_shown(value)} is not supported by this worker (it serves {rule.served}): "
                "leave it out", param=name)


def _prompt(body: dict[str, object]) -> tuple[list[int] | None, str | None]:
    prompt = body.get("prompt")
    # OpenAI allows a batch (a list of prompts); accept a batch of one, refuse more clearly
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest(400, "prompt is empty", param="prompt")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\ud800" is valid JSON)
            raise BadRequest(400, "prompt is not valid Unicode (a lone surrogate)", param="prompt") from None
        return None, prompt
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        if not prompt:
            raise BadRequest(400, "prompt is empty", param="prompt")
        if any(t < 0 for t in prompt):
            raise BadRequest(400, "prompt token ids must be non-negative", param="prompt")
        return list(prompt), None
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise BadRequest(400, "batched prompts are not supported: send one prompt per request", param="prompt")
    raise _bad("prompt", "a string or a list of token ids", prompt)


def _field(body: dict[str, object], name: str, default: object) -> object:
    value = body.get(name)
    return default if value is None else value


def parse_completion(body: object, model_name: str) -> CompletionRequest:
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "a string", model)
    if model is not None and model != model_name:
        raise BadRequest(
            404, f"unknown model {_shown(model)}; this worker serves {model_name!r}", "model_not_found", "model"
        )
    prompt_ids, prompt_text = _prompt(body)
    max_tokens = _field(body, "max_tokens", DEFAULT_MAX_TOKENS)
    if not _int_within(1)(max_tokens):
        raise _bad("max_tokens", "a positive integer", max_tokens)
    temperature = _field(body, "temperature", DEFAULT_TEMPERATURE)
    if not _number_within(0.0, MAX_TEMPERATURE)(temperature):
        raise _bad("temperature", f"a number within 0..{MAX_TEMPERATURE:g}", temperature)
    stream = _field(body, "stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", "true or false", stream)
    _check_unsupported(body)
    assert isinstance(max_tokens, int) and isinstance(temperature, int | float)  # checked just above
    return CompletionRequest(prompt_ids, prompt_text, max_tokens, float(temperature), stream)


def check_room(prompt_tokens: int, max_tokens: int, max_context: int, max_tokens_limit: int) -> None:
    """A 400 when the prompt and ``max_tokens`` do not fit the model's context, or ``max_tokens``
    is above this worker's ceiling (``--max-tokens-limit``)."""
    if prompt_tokens + max_tokens > max_context:
        raise BadRequest(
            400,
            f"prompt too long: {prompt_tokens} prompt tokens + max_tokens {max_tokens} "
            f"exceeds the model's context of {max_context}",
            "context_length_exceeded",
            "prompt",
        )
    if max_tokens > max_tokens_limit:
        raise BadRequest(
            400,
            f"max_tokens {max_tokens} exceeds this worker's limit of {max_tokens_limit} (--max-tokens-limit)",
            param="max_tokens",
        )
