"""Hostile clients of one worker (a real subprocess, a real tiny checkpoint, loopback only):
the attacks of issue 40 (a temperature of 1e-40, a 5,000-digit max_tokens, junk of every kind)
beside well-behaved streaming requests, which still get transformers' greedy text; every
malformed body is a 400 naming its field, and the worker stays ready.  Every wait is bounded.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_worker_server import FAST, Worker
from tests.support.hostile_bodies import MALFORMED

pytestmark = pytest.mark.integration

transformers = pytest.importorskip("transformers")

#: What each well-behaved request streams (the issue's victims stopped at 218 of 400).
TOKENS = 400
VICTIMS: list[object] = [[5 + (7 * i) % 250 for i in range(9)], "A well-behaved client asks politely",
                         [40 + (11 * i) % 200 for i in range(30)]]
ATTACKER_PROMPT = [9, 8, 7, 6, 5]
WAIT_S = 180.0
_HUGE_MAX_TOKENS = b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from warmpool_dev.testing_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny", layers=3, hidden=128, intermediate=256,
                           max_position_embeddings=1024, with_eos=False, seed=5)


@pytest.fixture(scope="module")
def worker(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    handle = Worker(model, *FAST, "--max-batch-size", "16", log_path=tmp_path_factory.mktemp("logs") / "worker.log")
    try:
        handle.wait_for("ready", lambda: handle.readyz()[0] == 200, timeout=WAIT_S)
        yield handle
    finally:
        handle.stop()


def _ids(model: Path, prompt: object) -> list[int]:
    from tokenizers import Tokenizer

    if isinstance(prompt, str):
        return list(Tokenizer.from_file(str(model / "tokenizer.json")).encode(prompt).ids)
    assert isinstance(prompt, list)
    return prompt


def _transformers_greedy(model: Path, prompts: list[object]) -> list[str]:
    """Each prompt's greedy completion of TOKENS tokens by transformers, decoded as the worker
    decodes (the checkpoint's tokenizer.json, special tokens skipped)."""
    import torch
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    texts = []
    for prompt in prompts:
        ids = _ids(model, prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
        generated = out[0, len(ids):].tolist()
        assert len(generated) == TOKENS
        texts.append(tokenizer.decode(generated, skip_special_tokens=True))
    return texts


def _stream(worker: Worker, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The streamed text, and every event (an in-band error included), to [DONE] or the bound."""
    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(worker.base + "/v1/completions", data=data, method="POST")
    events: list[dict[str, Any]] = []
    with urllib.request.urlopen(req, timeout=60) as response:
        assert response.status == 200
        for raw in response:
            line = raw.decode().strip()
            if line == "data: [DONE]" or len(events) > TOKENS + 10:
                break
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    text = "".join(e["choices"][0]["text"] for e in events if "choices" in e)
    return text, events


def _assert_400_naming(worker: Worker, raw: bytes, field: str | None, headers: dict[str, str] | None = None) -> None:
    status, payload = worker.request("POST", "/v1/completions", raw=raw,
                                     headers=headers or {"Content-Type": "application/json"})
    assert status == 400, (status, payload[:300])
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param"} and error["type"] == "invalid_request_error"
    assert error["param"] == field, error


def test_hostile_clients_beside_well_behaved_ones(worker: Worker, model: Path) -> None:
    expected = _transformers_greedy(model, [*VICTIMS, ATTACKER_PROMPT])
    streamed: dict[int, tuple[str, list[dict[str, Any]]]] = {}
    peak_running: list[float] = []
    done = threading.Event()

    def victim(index: int, prompt: object) -> None:
        streamed[index] = _stream(worker, {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0})

    def attacker() -> None:  # the attack: passes 0..2, overflowed logits / T
        streamed[len(VICTIMS)] = _stream(worker, {"prompt": ATTACKER_PROMPT, "max_tokens": TOKENS,
                                                  "temperature": 1e-40})

    def watch() -> None:
        deadline = time.monotonic() + WAIT_S
        while not done.is_set() and time.monotonic() < deadline:
            peak_running.append(worker.metrics().get(("warmpool_requests_running", ()), 0.0))
            time.sleep(0.05)

    threads = [threading.Thread(target=victim, args=(i, p)) for i, p in enumerate(VICTIMS)]
    threads += [threading.Thread(target=attacker), threading.Thread(target=watch)]
    for thread in threads:
        thread.start()
    try:
        # while they stream: every malformed body, each a 400 naming its field
        for _, raw, field in MALFORMED:
            _assert_400_naming(worker, raw, field)
        # a charset the header makes up (JSON is UTF-8 whatever it claims)
        _assert_400_naming(worker, _HUGE_MAX_TOKENS, "max_tokens",
                           {"Content-Type": "application/json; charset=no-such-charset"})
        # token ids the body's checks pass and the engine's vocabulary does not
        for ids in ([3, 99999], [3, 10**25]):
            _assert_400_naming(worker, json.dumps({"prompt": ids, "max_tokens": 1}).encode(), "prompt")
    finally:
        for thread in threads[:-1]:
            thread.join(WAIT_S)
        done.set()
        threads[-1].join(WAIT_S)
    for index, want in enumerate(expected):
        text, events = streamed[index]
        assert not [e for e in events if "error" in e], events[-3:]
        assert len(events) == TOKENS and events[-1]["choices"][0]["finish_reason"] == "length"
        assert text == want, f"request {index} differs from transformers' greedy text"
    assert max(peak_running, default=0) == len(VICTIMS) + 1  # the attacker shared the batch with them
    status, body = worker.readyz()
    assert status == 200 and body["stage"] == "ready"
