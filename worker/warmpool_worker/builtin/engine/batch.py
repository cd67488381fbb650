"""One step of a running batch: sequences join and leave at token boundaries.

A `SequenceState` is one generation: its prompt, its budget, its own KV cache (blocks from
the engine's shared pool, `kv_cache`), how far its prefill got and what it generated.  A
`BatchRunner.step` advances every sequence it is given by one step, in one forward pass
(`maths.forward_segments`):

* a sequence still in its prefill feeds its next *chunk* of prompt tokens.  Chunks end at
  multiples of ``chunk_tokens`` counted from the prompt's start, whatever else is in the
  batch, so a request is cut the same way served alone or among others.  Which sequences go
  in a step, and so how many prompt tokens the step holds, is the scheduler's choice (its
  per-step token budget, `batch_scheduler`): every sequence given advances by one chunk, and a
  prefilling sequence given *k* times by *k* chunks, each its own segment of the one forward
  pass, cut where *k* steps would cut it (per layer a segment's keys are written before the
  next segment's attention reads them, so the chunks see each other as over *k* steps);
* a decoding sequence feeds its last token and gets the next one;
* a sequence that was preempted (`preempt`: its KV dropped to make room) is recomputed: its
  prompt and the tokens it generated so far are prefilled again, in the same chunks, and
  the last chunk's logits give its next token, so it goes on where it stopped.

Logits are computed only for the rows that sample (a decode, or the last chunk of a
prompt), each row is checked finite on its own (a sequence whose logits hold NaN/Inf fails
with `NonFiniteLogitsError`; the others go on), and sampling is per row with each
sequence's own temperature.

One request cannot fail the others: what is done for one sequence alone (its first cache,
its sampling, its text) fails that sequence alone, as an error in its `StepOutcome`
(`SamplingError` for a row that could not be sampled).  Only the shared forward pass fails
the whole step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from warmpool_worker.builtin.engine.decoding import (
    SamplingError,
    check_generation,
    check_prompt,
    sample,
    text_increment,
)
from warmpool_worker.builtin.engine.kv_cache import (
    KVBlockPool,
    KVCache,
    KVExhausted,
    KVLease,
    blocks_for,
    kv_capacity,
)
from warmpool_worker.builtin.engine.maths import LayerWeights, Model, Segment, Weights, forward_segments
from warmpool_worker.builtin.engine.prefix_kv import PrefixKVStore
from warmpool_worker.engine_api import GenerationStep, NonFiniteLogitsError, RequestError

#: Where a prompt's chunks end, and what a prefill advances by at least in a step.
DEFAULT_CHUNK_TOKENS = 64


@dataclass(eq=False)
class SequenceState:
    """One generation in (or waiting for) the batch; the engine thread alone changes it."""

    ids: list[int]
    budget: int  # tokens it may generate (max_tokens, clamped to the context)
    temperature: float
    lease: KVLease
    cache: KVCache | None = None
    filled: int = 0  # positions whose K/V are in the cache
    generated: list[int] = field(default_factory=list)
    emitted: str = ""
    finished: bool = False

    @property
    def limit(self) -> int:
        return len(self.ids) + self.budget

    @property
    def blocks_needed(self) -> int:
        """Blocks it holds at most (its prompt and its whole budget): a request whose
        `blocks_needed` exceeds the whole pool can never finish, so it is refused up front."""
        return blocks_for(self.limit)

    @property
    def known(self) -> int:
        """Tokens it has: its prompt and what it generated."""
        return len(self.ids) + len(self.generated)

    @property
    def prefilling(self) -> bool:
        """Not yet started, or more than one known token still to feed (a prompt, or a
        preempted generation being recomputed)."""
        return self.cache is None or self.known - self.filled > 1

    def tokens(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end): the prompt's, then the generated ones."""
        prompt = len(self.ids)
        if start >= prompt:
            return self.generated[start - prompt : end - prompt]
        return self.ids[start:end] + self.generated[: max(0, end - prompt)]


@dataclass(frozen=True)
class StepOutcome:
    """What one step did for one sequence: a token (`step`), nothing yet (a prefill chunk
    that was not the last), or an `error` that ended it."""

    sequence: SequenceState
    step: GenerationStep | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class _Planned:
    sequence: SequenceState
    segment: Segment


class BatchRunner:
    """Runs steps of a batch on the engine's weights; the engine owns one (`LlamaEngine.batch`)."""

    def __init__(self, model: Model, core: Callable[[], Weights], layer: LayerWeights, pool: KVBlockPool,
                 new_cache: Callable[[int, int], KVCache], prefix_kv: PrefixKVStore,
                 decode: Callable[[Sequence[int]], str], eos_token_ids: Callable[[], frozenset[int]],
                 explain_non_finite: Callable[[str], str], generator: torch.Generator,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self._model = model
        self._core = core
        self._layer = layer
        self.pool = pool
        self._new_cache = new_cache
        self._prefix_kv = prefix_kv
        self._decode = decode
        self._eos = eos_token_ids
        self._explain = explain_non_finite
        self._generator = generator
        self.chunk_tokens = chunk_tokens

    def open(self, token_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0) -> SequenceState:
        """A sequence ready to run (checked; no KV yet, nothing reserved); RequestError if it cannot."""
        cfg = self._model.config
        ids = check_prompt(token_ids, cfg.max_position_embeddings, cfg.vocab_size)
        check_generation(max_new_tokens, temperature)
        if len(ids) >= cfg.max_position_embeddings:
            raise RequestError(f"the prompt is {len(ids)} tokens: no room left in the context of "
                               f"{cfg.max_position_embeddings} for a completion")
        budget = min(max_new_tokens, cfg.max_position_embeddings - len(ids))
        return SequenceState(ids, budget, temperature, self.pool.lease())

    def close(self, sequence: SequenceState) -> None:
        """Give back its KV blocks (reserved and used); idempotent."""
        sequence.finished = True
        sequence.cache = None
        sequence.lease.release()

    def preempt(self, sequence: SequenceState) -> None:
        """Drop its KV and give its blocks back; its next step recomputes its prompt and the
        tokens it generated (module docstring), so its greedy output is unchanged."""
        sequence.cache = None
        sequence.filled = 0
        sequence.lease.release()

    # ---- what a step needs (the scheduler plans with these) -------------------------------
    def next_tokens(self, sequence: SequenceState, after: int = 0) -> int:
        """Tokens its next step feeds: one for a decode, its next chunk for a prefill; with
        ``after`` chunks of it already planned for that step, the chunk after them (0: none left,
        or a decode, which feeds one token a step)."""
        if not sequence.prefilling:
            return 0 if after else 1
        cursor = sequence.filled
        for _ in range(after):
            cursor = self._chunk_end(sequence, cursor)
        return self._chunk_end(sequence, cursor) - cursor

    def chunks_within(self, sequence: SequenceState, budget: int) -> int:
        """How many of its chunks one step of ``budget`` tokens feeds when it is alone (at least
        one: a chunk, or a decode's token)."""
        chunks, used = 1, self.next_tokens(sequence)
        while (tokens := self.next_tokens(sequence, chunks)) and used + tokens <= budget:
            chunks, used = chunks + 1, used + tokens
        return chunks

    def blocks_wanted(self, sequence: SequenceState) -> int:
        """Blocks to reserve, beyond what its lease holds, before its next step can run: the
        prompt's (all it has) when it starts, else those its next chunk or token spills into."""
        positions = sequence.known if sequence.cache is None else sequence.filled + self.next_tokens(sequence)
        return max(0, blocks_for(positions) - sequence.lease.reserved)

    # ---- one step ------------------------------------------------------------------------
    def _chunk_end(self, sequence: SequenceState, start: int | None = None) -> int:
        """Where the chunk that starts at ``start`` (default: where its cache is filled to) ends."""
        step = self.chunk_tokens
        cursor = sequence.filled if start is None else start
        return min(sequence.known, (cursor // step + 1) * step)

    def _plan(self, sequences: Sequence[SequenceState]) -> tuple[list[_Planned], list[StepOutcome]]:
        """The segments of this step (one chunk or token per time a sequence is given), and the
        sequences that could not take part (each alone: its cache could not be allocated or grown)."""
        planned: list[_Planned] = []
        failed: list[StepOutcome] = []
        cursors: dict[int, int] = {}  # where each sequence's next segment of this step starts
        for sequence in sequences:
            key = id(sequence)
            if sequence.finished or (key in cursors and (cursors[key] < 0 or cursors[key] >= sequence.known)):
                continue  # done, failed earlier in this step, or nothing left to feed
            try:
                if sequence.cache is None:
                    self._start(sequence)
                assert sequence.cache is not None
                start = cursors.get(key, sequence.filled)
                end = self._chunk_end(sequence, start)
                tokens = sequence.tokens(start, end)
                sequence.lease.grow(sequence.cache, end, sequence.limit)
            except Exception as error:  # e.g. its cache could not be allocated: it alone fails
                cursors[key] = -1
                failed.append(StepOutcome(sequence, error=error))
                continue
            cursors[key] = end
            planned.append(_Planned(sequence, Segment(tokens, start, sequence.cache, end == sequence.known)))
        return planned, failed

    def _start(self, sequence: SequenceState) -> None:
        """Its first cache (sized for what it knows, in whole blocks), seeded from a stored warm prefix."""
        capacity = kv_capacity(sequence.known, 0, sequence.limit)
        if not sequence.lease.cover(blocks_for(capacity)):
            raise KVExhausted(f"the KV cache is full: no room for a {sequence.known}-token prompt's blocks")
        sequence.cache = sequence.lease.hold(self._new_cache(1, capacity))
        known = sequence.ids + sequence.generated
        sequence.filled = self._prefix_kv.seed(known, sequence.cache)

    def step(self, sequences: Sequence[SequenceState]) -> list[StepOutcome]:
        """Advance these sequences by one step (module docstring); finished ones are skipped.

        Raises what the forward pass raises (a weight that cannot be loaded): that ends every
        sequence of the step, which the caller closes.  A failure of one sequence's own work is
        its outcome's `error` (module docstring).
        """
        planned, outcomes = self._plan(sequences)
        if not planned:
            return outcomes
        with torch.inference_mode():
            logits = forward_segments(self._model, self._core(), self._layer, [p.segment for p in planned])
        row = 0
        finite = torch.isfinite(logits).all(dim=-1).tolist() if logits.shape[0] else []
        for item in planned:
            sequence, segment = item.sequence, item.segment
            sequence.filled = segment.start + len(segment.tokens)
            if not segment.logits:
                outcomes.append(StepOutcome(sequence))
                continue
            row_logits = logits[row : row + 1]
            ok = finite[row]
            row += 1
            if not ok:
                where = (f"at the prefill of a {len(sequence.ids)}-token prompt" if not sequence.generated
                         else f"at decode step {len(sequence.generated)}")
                outcomes.append(StepOutcome(sequence, error=NonFiniteLogitsError(self._explain(where))))
                continue
            try:
                outcomes.append(StepOutcome(sequence, self._next_token(sequence, row_logits)))
            except Exception as error:  # this row's sampling or text: its request ends, the rest go on
                outcomes.append(StepOutcome(sequence, error=SamplingError(
                    f"sampling failed for this request (temperature {sequence.temperature!r}): {error}")))
        return outcomes

    def _next_token(self, sequence: SequenceState, logits: torch.Tensor) -> GenerationStep:
        token = sample(logits, sequence.temperature, self._generator)[0]
        sequence.generated.append(token)
        if token in self._eos():
            sequence.finished = True
            return GenerationStep(token, "", True, "stop")
        final = len(sequence.generated) >= sequence.budget
        text, sequence.emitted = text_increment(self._decode, sequence.generated, sequence.emitted, final)
        if final:
            sequence.finished = True
            return GenerationStep(token, text, True, "length")
        return GenerationStep(token, text, False)
