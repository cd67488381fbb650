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


def _body(**fields: object) -> bytes:
    return json.dumps({"prompt": "hello", **fields}).encode()


# (what, body, the field the 400 names; None where the body is not JSON at all)
MALFORMED: list[tuple[str, bytes, str | None]] = [
    ("not JSON", b"{not json", None),
    ("not UTF-8", b'{"prompt": "\xff\xfe"}', None),
    ("empty body", b"", None),
    ("nested past the recursion limit", b"[" * 100_000 + b"]" * 100_000, None),
    ("a 5,000-digit max_tokens", b'{"prompt": "hello", "max_tokens": ' + b"9" * 5000 + b"}", "max_tokens"),
    ("a negative 5,000-digit max_tokens", b'{"prompt": "x", "max_tokens": -' + b"9" * 5000 + b"}", "max_tokens"),
    ("a 5,000-digit token id", b'{"prompt": [1, ' + b"7" * 5000 + b"]}", "prompt"),
    ("max_tokens NaN", b'{"prompt": "x", "max_tokens": NaN}', "max_tokens"),
    ("max_tokens Infinity", b'{"prompt": "x", "max_tokens": Infinity}', "max_tokens"),
    ("max_tokens a float", _body(max_tokens=16.0), "max_tokens"),
    ("max_tokens a boolean", _body(max_tokens=True), "max_tokens"),
    ("max_tokens negative", _body(max_tokens=-5), "max_tokens"),
    ("max_tokens a list", _body(max_tokens=[16]), "max_tokens"),
    ("temperature NaN", b'{"prompt": "x", "temperature": NaN}', "temperature"),
    ("temperature Infinity", b'{"prompt": "x", "temperature": Infinity}', "temperature"),
    ("temperature -Infinity", b'{"prompt": "x", "temperature": -Infinity}', "temperature"),
    ("temperature 1e999 (Infinity spelled as a number)", b'{"prompt": "x", "temperature": 1e999}', "temperature"),
    ("temperature above 2", _body(temperature=2.0000001), "temperature"),
    ("temperature negative", _body(temperature=-1e-40), "temperature"),
    ("temperature a boolean", _body(temperature=False), "temperature"),
    ("temperature a string", _body(temperature="0.5"), "temperature"),
    ("temperature an object", _body(temperature={"value": 0.5}), "temperature"),
    ("stream a string", _body(stream="true"), "stream"),
    ("stream a number", _body(stream=1), "stream"),
    ("model not a string", _body(model=["tiny"]), "model"),
    ("prompt missing", json.dumps({"max_tokens": 4}).encode(), "prompt"),
    ("prompt a number", json.dumps({"prompt": 42}).encode(), "prompt"),
    ("prompt an object", json.dumps({"prompt": {"text": "hi"}}).encode(), "prompt"),
    ("prompt booleans as token ids", json.dumps({"prompt": [True, False]}).encode(), "prompt"),
    ("prompt floats as token ids", json.dumps({"prompt": [1.0, 2.0]}).encode(), "prompt"),
    ("prompt a negative token id", json.dumps({"prompt": [3, -1]}).encode(), "prompt"),
    ("prompt nested junk", json.dumps({"prompt": [[[1]], {"a": None}]}).encode(), "prompt"),
    ("prompt mixed ids and text", json.dumps({"prompt": [1, "two"]}).encode(), "prompt"),
    ("prompt empty", json.dumps({"prompt": ""}).encode(), "prompt"),
    ("prompt an empty list", json.dumps({"prompt": []}).encode(), "prompt"),
    ("prompt a batch of two", json.dumps({"prompt": ["a", "b"]}).encode(), "prompt"),
    ("prompt a lone surrogate", b'{"prompt": "abc\\ud800"}', "prompt"),
    ("n above 1", _body(n=3), "n"),
    ("n zero", _body(n=0), "n"),
    ("n a boolean", _body(n=True), "n"),
    ("best_of above 1", _body(best_of=5), "best_of"),
    ("echo true", _body(echo=True), "echo"),
    ("echo a string", _body(echo="yes"), "echo"),
    ("logprobs asked for", _body(logprobs=2), "logprobs"),
    ("logprobs out of range", _body(logprobs=10**9), "logprobs"),
    ("suffix given", _body(suffix="the end"), "suffix"),
    ("stop given", _body(stop="\n"), "stop"),
    ("stop five sequences", _body(stop=["a", "b", "c", "d", "e"]), "stop"),
    ("stop a number", _body(stop=7), "stop"),
    ("top_p below 1", _body(top_p=0.9), "top_p"),
    ("top_p above 1", _body(top_p=1.5), "top_p"),
    ("top_p NaN", b'{"prompt": "x", "top_p": NaN}', "top_p"),
    ("top_p a boolean", _body(top_p=True), "top_p"),
    ("top_k set", _body(top_k=40), "top_k"),
    ("top_k below -1", _body(top_k=-2), "top_k"),
    ("top_k a float", _body(top_k=4.5), "top_k"),
    ("presence_penalty set", _body(presence_penalty=1.0), "presence_penalty"),
    ("presence_penalty out of range", _body(presence_penalty=1e308), "presence_penalty"),
    ("frequency_penalty Infinity", b'{"prompt": "x", "frequency_penalty": -Infinity}', "frequency_penalty"),
    ("seed given", _body(seed=1234), "seed"),
    ("seed 5,000 digits", b'{"prompt": "x", "seed": ' + b"1" * 5000 + b"}", "seed"),
    ("logit_bias given", _body(logit_bias={"50256": -100}), "logit_bias"),
    ("logit_bias a list", _body(logit_bias=[1, 2]), "logit_bias"),
    ("stream_options asking for usage", _body(stream=True, stream_options={"include_usage": True}), "stream_options"),
    ("stream_options a string", _body(stream_options="usage"), "stream_options"),
]


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
    refused = _refused(_body(model="someone-elses-model"))
    assert (refused.status, refused.kind, refused.param) == (404, "model_not_found", "model")


@pytest.mark.parametrize("temperature", [0, 1e-40, 5e-324, GREEDY_BELOW_TEMPERATURE, 0.7, MAX_TEMPERATURE])
def test_every_temperature_in_range_is_accepted(temperature: float) -> None:
    assert _parsed(_body(temperature=temperature)).temperature == temperature


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
