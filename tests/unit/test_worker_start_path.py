"""The worker's start path: the tokenizer read while torch imports, torch imported without the
device-backend scan.  What these save is measured by `bench coldstart`, never asserted here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from warmpool_dev.testing_models import make_tiny_llama
from warmpool_worker import device
from warmpool_worker.builtin import engine as engine_package
from warmpool_worker.builtin.engine import load_engine
from warmpool_worker.builtin.runtime import WorkerRuntime
from warmpool_worker.cli import build_parser, serve_config
from warmpool_worker.engine_api import ModelLoadError
from warmpool_worker.tokenizer_file import TokenizerRead, read_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    return make_tiny_llama(tmp_path / "tiny", layers=2)


def test_tokenizer_read_in_a_thread_is_the_file_parsed(model: Path) -> None:
    early = TokenizerRead(model).result()
    assert isinstance(early, Tokenizer)
    assert early.encode("hello world").ids == read_tokenizer(model).encode("hello world").ids


@pytest.mark.parametrize(("content", "problem"), [(None, "file is missing"), ("{not json", "cannot parse tokenizer")])
def test_tokenizer_read_in_a_thread_reports_a_bad_file_when_asked(model: Path, content: str | None,
                                                                 problem: str) -> None:
    path = model / "tokenizer.json"
    if content is None:
        path.unlink()
    else:
        path.write_text(content)
    read = TokenizerRead(model)  # the thread's failure is held, not raised in the thread
    with pytest.raises(ModelLoadError, match=rf"tokenizer\.json: {problem}"):
        read.result()


def test_load_engine_takes_the_tokenizer_read_begun_earlier(model: Path) -> None:
    read = TokenizerRead(model)
    engine = load_engine(model, tokenizer=read)
    assert engine.tokenizer is read.result()


def test_a_bad_checkpoint_is_reported_before_a_bad_tokenizer(model: Path) -> None:
    (model / "tokenizer.json").unlink()
    (model / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no safetensors weights"):
        load_engine(model, tokenizer=TokenizerRead(model))


class _Stop(Exception):
    pass


def _tokenizer_handed_to_load_engine(model: Path, monkeypatch: pytest.MonkeyPatch, *flags: str) -> Any:
    seen: dict[str, Any] = {}

    def fake_load_engine(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise _Stop  # the start path up to the engine is what is under test

    monkeypatch.setattr(engine_package, "load_engine", fake_load_engine)
    config = serve_config(build_parser().parse_args(["serve", "--model", str(model), "--device", "cpu", *flags]))
    threads = torch.get_num_threads()
    try:
        with pytest.raises(_Stop):
            WorkerRuntime(config, "cpu").startup()
    finally:
        torch.set_num_threads(threads)  # startup sizes this process's pool: the other tests keep theirs
    return seen["tokenizer"]


def test_startup_begins_the_tokenizer_read_before_the_engine_loads(model: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    read = _tokenizer_handed_to_load_engine(model, monkeypatch)
    assert isinstance(read, TokenizerRead)
    assert isinstance(read.result(), Tokenizer)


def test_startup_on_a_partial_view_leaves_the_tokenizer_to_load_engine(model: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # its tokenizer.json may still be filling: load_engine waits for the file before reading it
    assert _tokenizer_handed_to_load_engine(model, monkeypatch, "--partial-cache") is None


def test_import_torch_turns_off_the_device_backend_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(device.TORCH_BACKEND_AUTOLOAD_ENV, raising=False)
    assert device.import_torch() is torch
    assert os.environ[device.TORCH_BACKEND_AUTOLOAD_ENV] == "0"


def test_import_torch_keeps_a_backend_scan_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(device.TORCH_BACKEND_AUTOLOAD_ENV, "1")
    device.import_torch()
    assert os.environ[device.TORCH_BACKEND_AUTOLOAD_ENV] == "1"
