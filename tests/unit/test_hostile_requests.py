"""One hostile request cannot harm the others: every malformed completion body is a 400 naming
the field; the sampler computes for every temperature the API accepts; a request whose row
fails inside a batch step (its sampling, its callbacks) ends alone while its batch-mates get
the tokens they get served alone.  The batch runs on a real tiny checkpoint."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from warmpool_dev.testing_models import make_tiny_llama
from warmpool_worker.builtin.batch_scheduler import KVCacheTooSmall
from warmpool_worker.builtin.completion_request import (
    DEFAULT_MAX_TOKENS,
    MAX_TEMPERATURE,
    SHOWN_CHARS,
    CompletionRequest,
    load_body,
    parse_completion,
)
from warmpool_worker.builtin.engine import load_engine
from warmpool_worker.builtin.engine.decoding import GREEDY_BELOW_TEMPERATURE, SamplingError, sample
from warmpool_worker.engine_api import GenerationStep
from warmpool_worker.http_app import BadRequest

from tests.support.hostile_bodies import MALFORMED, body_with
from tests.unit.test_batch_scheduler import Serving, _prompt, _request

pytestmark = pytest.mark.unit

MODEL = "tiny"
#: Tokens each well-behaved request asks for: long enough to share many steps with the attacker.
TOKENS = 40


def _parsed(raw: bytes) -> CompletionRequest:
    return parse_completion(load_body(raw), MODEL)


def _refused(raw: bytes) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        _parsed(raw)
    return caught.value


@pytest.mark.parametrize(("body", "field"), [(b, f) for _, b, f in MALFORMED], ids=[w for w, _, _ in MALFORMED])
def test_every_malformed_body_is_a_400_naming_the_field(body: bytes, field: str | None) -> None:
    refused = _refused(body)
    assert refused.status == 400, refused.message
    assert refused.kind == "invalid_request_error"
    assert refused.param == field, refused.message
    if field is not None:
        assert field in refused.message
    assert len(refused.message) < 4 * SHOWN_CHARS + 200  # a huge bad value is quoted in part only


def test_a_request_for_another_model_is_a_404() -> None:
    refused = _refused(body_with(model="someone-elses-model"))
    assert (refused.status, refused.kind, refused.param) == (404, "model_not_found", "model")


@pytest.mark.parametrize("temperature", [0, 1e-40, 5e-324, GREEDY_BELOW_TEMPERATURE, 0.7, MAX_TEMPERATURE])
def test_every_temperature_in_range_is_accepted(temperature: float) -> None:
    assert _parsed(body_with(temperature=temperature)).temperature == temperature


def test_nulls_and_no_op_values_ask_for_the_defaults() -> None:
    parsed = _parsed(json.dumps({
        "prompt": ["hi"], "max_tokens": None, "temperature": None, "stream": None, "model": MODEL, "n": 1,
        "best_of": 1, "echo": False, "logprobs": None, "suffix": None, "stop": [], "top_p": 1, "top_k": -1,
        "presence_penalty": 0, "frequency_penalty": 0.0, "seed": None, "logit_bias": {},
        "stream_options": {"include_usage": False}, "user": "someone", "an_unknown_field": [1, {"x": 2}],
    }).encode())
    assert parsed == parse_completion({"prompt": "hi"}, MODEL)
    assert parsed.max_tokens == DEFAULT_MAX_TOKENS


# ---- the sampler -------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-30, 1e-6, 0.0])
def test_a_temperature_below_the_greedy_threshold_is_greedy(temperature: float) -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3)) * 8
    assert sample(logits, temperature, torch.Generator()) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [GREEDY_BELOW_TEMPERATURE, 1e-3, 1.0, MAX_TEMPERATURE])
def test_sampling_computes_whatever_the_logits_magnitude(temperature: float) -> None:
    huge = torch.tensor([[3e38, -3e38, 1e30, 0.0], [-1.0, -2.0, -3e38, -1.5]])
    tokens = sample(huge, temperature, torch.Generator().manual_seed(0))
    assert len(tokens) == 2 and all(0 <= t < 4 for t in tokens)
    if temperature <= 1e-3:  # cold enough that the top logit wins for sure
        assert tokens == [0, 0]


# ---- one failing row in a batch ----------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("m") / "tiny", layers=3, seed=9, max_position_embeddings=512,
                           with_eos=False)


def test_a_row_that_fails_to_sample_fails_alone_in_the_engine_step(model_dir: Path) -> None:
    engine = load_engine(model_dir, chunk_tokens=16)
    prompts = [_prompt(5), _prompt(20, offset=1), _prompt(9, offset=2)]
    alone = [[s.token_id for s in engine.generate(p, 8)] for p in prompts]
    sequences = [engine.open_sequence(p, 8) for p in prompts]
    sequences[1].temperature = "hot"  # type: ignore[assignment]  # a value past every check: the draw raises
    tokens: list[list[int]] = [[], [], []]
    errors: list[BaseException | None] = [None, None, None]
    for _ in range(100):  # bounded
        running = [s for s in sequences if not s.finished]
        if not running:
            break
        for outcome in engine.step(running):
            index = sequences.index(outcome.sequence)
            if outcome.error is not None:
                errors[index] = outcome.error
                engine.close_sequence(outcome.sequence)
            elif outcome.step is not None:
                tokens[index].append(outcome.step.token_id)
    assert isinstance(errors[1], SamplingError) and "'hot'" in str(errors[1]) and tokens[1] == []
    assert errors[0] is errors[2] is None
    assert [tokens[0], tokens[2]] == [alone[0], alone[2]]
    for sequence in sequences:
        engine.close_sequence(sequence)
    assert engine.kv_blocks().used == engine.kv_blocks().reserved == 0


@pytest.fixture()
def serving(model_dir: Path) -> Iterator[Serving]:
    handle = Serving(model_dir)
    try:
        yield handle
    finally:
        handle.scheduler.stop()


def test_a_tiny_temperature_beside_greedy_requests_breaks_nothing(serving: Serving) -> None:
    """The issue's attack: temperature 1e-40 passed the API's check and its draw raised inside
    the step, which ended every request of the batch."""
    victims = [_prompt(12), _prompt(33, offset=2), _prompt(7, offset=5)]
    alone = [serving.alone(p, TOKENS) for p in victims]
    attack_prompt = _prompt(10, offset=9)
    attack_alone = serving.alone(attack_prompt, TOKENS)
    with serving.gate:  # all four join the same first step
        running = [serving.submit(p, TOKENS) for p in victims]
        attacker = _request(attack_prompt, TOKENS, temperature=1e-40)
        serving.scheduler.submit(attacker.job)
    for collected in (*running, attacker):
        collected.wait()
    assert [c.error for c in (*running, attacker)] == [None] * 4
    assert [c.tokens for c in running] == alone
    assert attacker.tokens == attack_alone  # greedy, as documented


def test_a_request_whose_draw_fails_in_the_scheduler_ends_alone(serving: Serving) -> None:
    victims = [_prompt(12), _prompt(33, offset=2)]
    alone = [serving.alone(p, TOKENS) for p in victims]
    with serving.gate:  # no step runs until the bad row is in place
        running = [serving.submit(p, TOKENS) for p in victims]
        bad = _request(_prompt(6, offset=4), TOKENS)
        serving.scheduler.submit(bad.job)
        bad.job.sequence.temperature = "hot"  # past every check: the draw raises inside the step
    for collected in (*running, bad):
        collected.wait()
    assert isinstance(bad.error, SamplingError) and bad.tokens == []
    assert [c.error for c in running] == [None, None]
    assert [c.tokens for c in running] == alone
    assert serving.scheduler.counts() == (0, 0)
    assert serving.engine.kv_blocks().used == serving.engine.kv_blocks().reserved == 0


def test_a_request_whose_callback_fails_ends_alone(serving: Serving) -> None:
    """A request's own callback raising (its handler's side broke) ended the batch's thread
    before: every request then waited forever."""
    victims = [_prompt(12), _prompt(33, offset=2)]
    alone = [serving.alone(p, TOKENS) for p in victims]
    broken = _request(_prompt(6, offset=4), TOKENS)
    delivered: list[int] = []

    def step_then_break(item: GenerationStep) -> None:
        delivered.append(item.token_id)
        if len(delivered) == 3:
            raise ConnectionError("the handler's side of this request broke")

    broken.job.on_step = step_then_break
    with serving.gate:
        running = [serving.submit(p, TOKENS) for p in victims]
        serving.scheduler.submit(broken.job)
    for collected in (*running, broken):
        collected.wait()
    assert isinstance(broken.error, ConnectionError) and len(delivered) == 3
    assert [c.error for c in running] == [None, None]
    assert [c.tokens for c in running] == alone
    assert serving.scheduler.counts() == (0, 0)


def test_a_request_larger_than_the_whole_kv_cache_is_refused_naming_max_tokens(model_dir: Path) -> None:
    """Refused at submission, as its own error type: the HTTP side answers a 400 naming max_tokens."""
    small = Serving(model_dir, kv_cache_bytes=64 * 1024)  # 768 bytes a position: under 100 positions
    try:
        with pytest.raises(KVCacheTooSmall, match="--kv-cache-bytes"):
            small.scheduler.submit(_request(_prompt(20), 300).job)
        assert small.alone(_prompt(20), 8) == small.alone(_prompt(20), 8)  # it goes on serving
    finally:
        small.scheduler.stop()
