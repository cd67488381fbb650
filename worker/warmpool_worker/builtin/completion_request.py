"""The body of ``POST /v1/completions``, checked: a 400 (or 404 for another model) naming the
field that is wrong, as an OpenAI-compatible server answers."""

from __future__ import annotations

from dataclasses import dataclass

from warmpool_worker.http_app import BadRequest

DEFAULT_MAX_TOKENS = 16
MAX_TEMPERATURE = 2.0


@dataclass(frozen=True)
class CompletionRequest:
    prompt_ids: list[int] | None
    prompt_text: str | None
    max_tokens: int
    temperature: float
    stream: bool


def parse_completion(body: object, model_name: str) -> CompletionRequest:
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(
            404, f"unknown model {model!r}; this worker serves {model_name!r}", "model_not_found", "model"
        )
    prompt = body.get("prompt")
    # OpenAI allows a batch (a list of prompts); accept a batch of one, refuse more clearly
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest(400, "prompt is empty", param="prompt")
        prompt_text = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise BadRequest(400, "prompt is empty", param="prompt")
        if any(t < 0 for t in prompt):
            raise BadRequest(400, "prompt token ids must be non-negative", param="prompt")
        prompt_ids = list(prompt)
    elif isinstance(prompt, list):
        raise BadRequest(
            400, "batched prompts are not supported: send one prompt per request", param="prompt"
        )
    else:
        raise BadRequest(400, "prompt must be a string or a list of token ids", param="prompt")
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest(
            400, f"max_tokens must be a positive integer, got {max_tokens!r}", param="max_tokens"
        )
    temperature = body.get("temperature", 1.0)
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not 0 <= temperature <= MAX_TEMPERATURE
    ):
        raise BadRequest(
            400,
            f"temperature must be a number within 0..{MAX_TEMPERATURE:g}, got {temperature!r}",
            param="temperature",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(400, "stream must be true or false", param="stream")
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
