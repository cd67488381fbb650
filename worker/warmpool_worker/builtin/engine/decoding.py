"""From logits to tokens and from tokens to streamed text: sampling and text increments.

Sampling computes for every temperature the API accepts (0..2, `completion_request`):

* below `GREEDY_BELOW_TEMPERATURE` (1e-5, vLLM's threshold too) a draw is greedy (argmax).
  softmax(logits / T) at such a T is one-hot to float32 precision wherever the top two
  logits differ by more than 1e-3 (the runner-up's weight is below e^-100),
  and logits / T itself overflows (T = 1e-40 is subnormal in float32: logit / T = Inf,
  softmax NaN, `torch.multinomial` raises), so the argmax is both the limit and what computes;
* above it the logits are shifted by their maximum before dividing, so every row has a 0
  and no value is above it: softmax stays finite whatever the logits' magnitude.

A row that still fails to sample fails as a `SamplingError` (`batch` wraps what was raised),
which ends that request alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from warmpool_worker.engine_api import RequestError

#: Temperatures below this sample greedily (module docstring).
GREEDY_BELOW_TEMPERATURE = 1e-5


class SamplingError(RuntimeError):
    """One row could not be sampled: its request fails, the batch around it goes on."""


def check_prompt(token_ids: Sequence[int], max_context: int, vocab_size: int) -> list[int]:
    ids = list(token_ids)
    if not ids:
        raise RequestError("the prompt is empty")
    if len(ids) > max_context:
        raise RequestError(f"the prompt is {len(ids)} tokens, longer than the context of {max_context}")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"token ids out of the vocabulary (0..{vocab_size - 1}): {bad[:5]}")
    return ids


def check_generation(max_new_tokens: int, temperature: float) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise RequestError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise RequestError(f"temperature must be a finite number >= 0, got {temperature!r}")


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> list[int]:
    """logits [B, V] -> one token per row: argmax below `GREEDY_BELOW_TEMPERATURE`, else a draw
    from softmax(logits / T), computed shifted so that it cannot overflow (module docstring)."""
    if not temperature >= GREEDY_BELOW_TEMPERATURE:  # NaN included: never divide by it
        return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
    scores = logits.float()
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / temperature
    probs = torch.softmax(scores, dim=-1).cpu()
    return [int(t) for t in torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()]


def text_increment(decode: Callable[[Sequence[int]], str], generated: list[int], emitted: str,
                   final: bool = False) -> tuple[str, str]:
    """(new text to send, all text sent so far) after the latest token of `generated`."""
    text = decode(generated)
    if text.endswith("\ufffd") and not final:  # mid-codepoint: wait for the rest of the bytes
        return "", emitted
    if not text.startswith(emitted):  # the tokenizer re-merged earlier text: send only what is new
        common = 0
        for a, b in zip(text, emitted, strict=False):
            if a != b:
                break
            common += 1
        return text[common:], text
    return text[len(emitted):], text
