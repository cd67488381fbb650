"""The engine's batch step on real tiny checkpoints: sequences at different positions in one
forward pass, prompt chunks, KV blocks, a NaN row among finite ones."""

from __future__ import annotations

from pathlib import Path

import pytest
from warmpool_dev.testing_models import make_tiny_llama
from warmpool_worker.builtin.engine import KV_BLOCK_TOKENS, LlamaEngine, load_engine
from warmpool_worker.builtin.engine.batch import SequenceState, StepOutcome
from warmpool_worker.defaults import DEFAULT_KV_CACHE_BYTES
from warmpool_worker.engine_api import NonFiniteLogitsError, RequestError

pytestmark = pytest.mark.unit

CHUNK = 16
POISON_TOKEN = 100


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("m") / "tiny", layers=3, seed=7, max_position_embeddings=512,
                           with_eos=False)


def _engine(model_dir: Path, kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES) -> LlamaEngine:
    return load_engine(model_dir, chunk_tokens=CHUNK, kv_cache_bytes=kv_cache_bytes)


def _prompt(length: int, offset: int = 0) -> list[int]:
    return [5 + (offset + 7 * i) % 250 for i in range(length)]


def _alone(engine: LlamaEngine, ids: list[int], tokens: int) -> list[int]:
    return [step.token_id for step in engine.generate(ids, tokens)]


def _run_together(engine: LlamaEngine, sequences: list[SequenceState]) -> tuple[dict[int, list[int]], list[int]]:
    """Step all of them to the end; their tokens, and the batch size of each step."""
    tokens: dict[int, list[int]] = {id(s): [] for s in sequences}
    sizes: list[int] = []
    for _ in range(2000):  # bounded
        running = [s for s in sequences if not s.finished]
        if not running:
            break
        outcomes: list[StepOutcome] = engine.step(running)
        sizes.append(len(outcomes))
        for outcome in outcomes:
            assert outcome.error is None, outcome.error
            if outcome.step is not None:
                tokens[id(outcome.sequence)].append(outcome.step.token_id)
    for sequence in sequences:
        engine.close_sequence(sequence)
    return tokens, sizes


def test_one_step_for_many_sequences_gives_each_its_tokens_alone(model_dir: Path) -> None:
    engine = _engine(model_dir)
    lengths = [1, 3, 15, 16, 17, 40, 64, 100]
    prompts = [_prompt(n, offset=n) for n in lengths]
    expected = [_alone(engine, p, 6) for p in prompts]
    sequences = [engine.open_sequence(p, 6) for p in prompts]
    tokens, _ = _run_together(engine, sequences)
    assert [tokens[id(s)] for s in sequences] == expected
    assert engine.kv_blocks().used == engine.kv_blocks().reserved == 0  # all given back


def test_a_long_prompt_joins_a_running_decode_one_chunk_per_step(model_dir: Path) -> None:
    """The decode beside a long prompt gets a token at every step: the prompt never stalls it
    for more than one chunk, and its own chunks stay within the step's prefill budget."""
    engine = _engine(model_dir)
    short, long = _prompt(5), _prompt(5 * CHUNK + 3, offset=1)
    expected_short, expected_long = _alone(engine, short, 12), _alone(engine, long, 3)
    running = engine.open_sequence(short, 12)
    first = engine.step([running])
    assert first[0].step is not None  # a 5-token prompt is one chunk: its first token is out
    joining = engine.open_sequence(long, 3)
    per_step: list[tuple[bool, int]] = []
    tokens = {id(running): [first[0].step.token_id], id(joining): []}
    while not joining.finished:
        filled_before = joining.filled
        outcomes = engine.step([s for s in (running, joining) if not s.finished])
        got = {id(o.sequence): o.step for o in outcomes}
        if not running.finished:
            per_step.append((got.get(id(running)) is not None, joining.filled - filled_before))
        for key, step in got.items():
            if step is not None:
                tokens[key].append(step.token_id)
    prefill_steps = [(decoded, prefilled) for decoded, prefilled in per_step if prefilled > 1]
    assert len(prefill_steps) == 6  # 83 prompt tokens in chunks of at most 16
    assert all(decoded for decoded, _ in per_step)  # the decode moved at every step
    assert all(prefilled <= CHUNK for _, prefilled in per_step)
    while not running.finished:
        outcomes = engine.step([running])
        tokens[id(running)].append(outcomes[0].step.token_id)  # type: ignore[union-attr]
    assert tokens[id(running)] == expected_short and tokens[id(joining)] == expected_long
    engine.close_sequence(running)
    engine.close_sequence(joining)


def test_kv_blocks_grow_with_tokens_and_come_back(model_dir: Path) -> None:
    engine = _engine(model_dir)
    sequence = engine.open_sequence(_prompt(20), 60)
    assert sequence.blocks_needed == -(-80 // KV_BLOCK_TOKENS)
    assert sequence.lease.try_reserve(sequence.blocks_needed)
    stats = engine.kv_blocks()
    assert stats.reserved == sequence.blocks_needed and stats.used == 0  # reserved, nothing allocated yet
    assert stats.free == stats.total - stats.reserved
    used: list[int] = []
    while not sequence.finished:
        engine.step([sequence])
        used.append(engine.kv_blocks().used)
    assert used[0] < sequence.blocks_needed and used == sorted(used)  # allocated as tokens come
    assert max(used) <= sequence.blocks_needed
    engine.close_sequence(sequence)
    assert engine.kv_blocks().used == engine.kv_blocks().reserved == 0


def test_the_pool_is_bounded_by_bytes(model_dir: Path) -> None:
    engine = _engine(model_dir)
    per_block = engine.kv_pool.block_bytes
    small = _engine(model_dir, kv_cache_bytes=10 * per_block + per_block // 2)
    assert small.kv_blocks().total == 10
    sequence = small.open_sequence(_prompt(100), 100)  # 200 positions: 13 blocks
    assert not sequence.lease.try_reserve(sequence.blocks_needed)
    from warmpool_worker.engine_api import ModelLoadError

    with pytest.raises(ModelLoadError, match="kv-cache-bytes"):
        _engine(model_dir, kv_cache_bytes=per_block - 1)


def test_non_finite_logits_fail_only_their_own_sequence(tmp_path: Path) -> None:
    engine = _engine(make_tiny_llama(tmp_path / "poisoned", layers=2, poison_tokens=(POISON_TOKEN,),
                                     max_position_embeddings=256, with_eos=False))
    good = [_prompt(9), _prompt(30, offset=3)]
    expected = [_alone(engine, p, 5) for p in good]
    assert POISON_TOKEN not in expected[0] + expected[1]  # the good ones never feed the poisoned row
    bad = engine.open_sequence([5, POISON_TOKEN, 7], 5)
    sequences = [engine.open_sequence(good[0], 5), bad, engine.open_sequence(good[1], 5)]
    tokens: dict[int, list[int]] = {id(s): [] for s in sequences}
    errors: list[BaseException] = []
    for _ in range(100):
        running = [s for s in sequences if not s.finished]
        if not running:
            break
        for outcome in engine.step(running):
            if outcome.error is not None:
                errors.append(outcome.error)
                engine.close_sequence(outcome.sequence)
            elif outcome.step is not None:
                tokens[id(outcome.sequence)].append(outcome.step.token_id)
    assert len(errors) == 1 and isinstance(errors[0], NonFiniteLogitsError)
    assert "model.embed_tokens.weight" in str(errors[0]) and "'poisoned'" in str(errors[0])
    assert [tokens[id(sequences[0])], tokens[id(sequences[2])]] == expected
    assert tokens[id(bad)] == []


def test_open_refuses_what_the_engine_cannot_serve(model_dir: Path) -> None:
    engine = _engine(model_dir)
    with pytest.raises(RequestError, match="empty"):
        engine.open_sequence([], 3)
    with pytest.raises(RequestError, match="no room"):
        engine.open_sequence(_prompt(512), 3)
    with pytest.raises(RequestError, match="max_new_tokens"):
        engine.open_sequence([5], 0)
    assert engine.open_sequence(_prompt(500), 100).budget == 12  # clamped to the context


def test_packed_weights_make_each_row_independent_of_its_batch(tmp_path: Path) -> None:
    """A bf16 checkpoint served in float32 on CPU: its linear layers are packed for oneDNN, whose
    result for a row does not depend on the rows beside it, so a sequence's logits in a batch of
    twelve are bit for bit its logits alone."""
    import torch
    from warmpool_worker.builtin.engine.maths import Segment, forward_segments

    engine = _engine(make_tiny_llama(tmp_path / "bf16", layers=2, dtype="bfloat16", max_position_embeddings=256))
    assert engine.weights.layer(0)["w_up"].is_mkldnn and engine.weights.core()["head"].is_mkldnn
    prompts = [_prompt(n, offset=n) for n in (1, 5, 16, 23, 40, 3, 9, 64, 2, 31, 17, 8)]

    def logits(batch: list[list[int]]) -> torch.Tensor:
        segments = [Segment(p, 0, engine.new_cache(1, len(p)), True) for p in batch]
        with torch.inference_mode():
            return forward_segments(engine._model, engine.weights.core(), engine.weights.layer, segments)

    together = logits(prompts)
    alone = torch.cat([logits([p]) for p in prompts])
    assert torch.equal(together, alone)


def test_a_prompt_given_k_times_advances_k_chunks_in_one_step_and_answers_as_alone(model_dir: Path) -> None:
    """Several chunks of one prompt in one forward pass, cut where single steps cut it: the same
    tokens as the prompt served alone, and nothing more fed than the prompt has."""
    engine = _engine(model_dir)
    prompt = _prompt(3 * CHUNK + 5, offset=3)  # chunks of 16, 16, 16 and 5
    expected = _alone(engine, prompt, 6)
    sequence = engine.open_sequence(prompt, 6)
    assert [engine.next_tokens(sequence, k) for k in range(5)] == [CHUNK, CHUNK, CHUNK, 5, 0]
    outcomes = engine.step([sequence] * 3)
    assert len(outcomes) == 3 and all(o.step is None and o.error is None for o in outcomes)
    assert sequence.filled == 3 * CHUNK
    outcomes = engine.step([sequence] * 4)  # one chunk left: given more often, it is fed once
    assert len(outcomes) == 1 and outcomes[0].step is not None
    tokens = [outcomes[0].step.token_id]
    assert (engine.next_tokens(sequence), engine.next_tokens(sequence, 1)) == (1, 0)  # a decode: one a step
    while not sequence.finished:
        step = engine.step([sequence, sequence])
        assert len(step) == 1 and step[0].step is not None
        tokens.append(step[0].step.token_id)
    assert tokens == expected
    engine.close_sequence(sequence)


def test_a_generation_alone_takes_the_steps_the_scheduler_would_give_it(model_dir: Path) -> None:
    """Alone, a step feeds as many chunks as the step's budget holds (so warm-up times the steps a
    request alone is served in), never less than one, and a decode one token."""
    engine = _engine(model_dir)
    short, long = engine.open_sequence(_prompt(120), 4), engine.open_sequence(_prompt(300, offset=2), 4)
    assert engine.batch.chunks_within(short, 256) == 8  # 7 chunks of 16 and one of 8: the whole prompt
    assert engine.batch.chunks_within(long, 256) == 16  # 256 of its 300 tokens
    assert engine.batch.chunks_within(long, 10) == 1  # a chunk beyond the budget still goes alone
    engine.step([short] * 8)
    assert short.filled == 120 and engine.batch.chunks_within(short, 256) == 1  # decoding: one token a step
    engine.close_sequence(short)
    engine.close_sequence(long)
