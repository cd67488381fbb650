"""Malformed ``POST /v1/completions`` bodies a hostile client sends, each with the field the
worker's 400 must name (None where the body is not JSON at all): shared by the unit test of
the body's checks and the worker's hostile-clients test."""

from __future__ import annotations

import json


def body_with(**fields: object) -> bytes:
    """A completion body with a good prompt and these fields."""
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
    ("max_tokens a float", body_with(max_tokens=16.0), "max_tokens"),
    ("max_tokens a boolean", body_with(max_tokens=True), "max_tokens"),
    ("max_tokens negative", body_with(max_tokens=-5), "max_tokens"),
    ("max_tokens a list", body_with(max_tokens=[16]), "max_tokens"),
    ("temperature NaN", b'{"prompt": "x", "temperature": NaN}', "temperature"),
    ("temperature Infinity", b'{"prompt": "x", "temperature": Infinity}', "temperature"),
    ("temperature -Infinity", b'{"prompt": "x", "temperature": -Infinity}', "temperature"),
    ("temperature 1e999 (Infinity spelled as a number)", b'{"prompt": "x", "temperature": 1e999}', "temperature"),
    ("temperature above 2", body_with(temperature=2.0000001), "temperature"),
    ("temperature negative", body_with(temperature=-1e-40), "temperature"),
    ("temperature a boolean", body_with(temperature=False), "temperature"),
    ("temperature a string", body_with(temperature="0.5"), "temperature"),
    ("temperature an object", body_with(temperature={"value": 0.5}), "temperature"),
    ("stream a string", body_with(stream="true"), "stream"),
    ("stream a number", body_with(stream=1), "stream"),
    ("model not a string", body_with(model=["tiny"]), "model"),
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
    ("n above 1", body_with(n=3), "n"),
    ("n zero", body_with(n=0), "n"),
    ("n a boolean", body_with(n=True), "n"),
    ("best_of above 1", body_with(best_of=5), "best_of"),
    ("echo true", body_with(echo=True), "echo"),
    ("echo a string", body_with(echo="yes"), "echo"),
    ("logprobs asked for", body_with(logprobs=2), "logprobs"),
    ("logprobs out of range", body_with(logprobs=10**9), "logprobs"),
    ("suffix given", body_with(suffix="the end"), "suffix"),
    ("stop given", body_with(stop="\n"), "stop"),
    ("stop five sequences", body_with(stop=["a", "b", "c", "d", "e"]), "stop"),
    ("stop a number", body_with(stop=7), "stop"),
    ("top_p below 1", body_with(top_p=0.9), "top_p"),
    ("top_p above 1", body_with(top_p=1.5), "top_p"),
    ("top_p NaN", b'{"prompt": "x", "top_p": NaN}', "top_p"),
    ("top_p a boolean", body_with(top_p=True), "top_p"),
    ("top_k set", body_with(top_k=40), "top_k"),
    ("top_k below -1", body_with(top_k=-2), "top_k"),
    ("top_k a float", body_with(top_k=4.5), "top_k"),
    ("presence_penalty set", body_with(presence_penalty=1.0), "presence_penalty"),
    ("presence_penalty out of range", body_with(presence_penalty=1e308), "presence_penalty"),
    ("frequency_penalty Infinity", b'{"prompt": "x", "frequency_penalty": -Infinity}', "frequency_penalty"),
    ("seed given", body_with(seed=1234), "seed"),
    ("seed 5,000 digits", b'{"prompt": "x", "seed": ' + b"1" * 5000 + b"}", "seed"),
    ("logit_bias given", body_with(logit_bias={"50256": -100}), "logit_bias"),
    ("logit_bias a list", body_with(logit_bias=[1, 2]), "logit_bias"),
    ("stream_options asking for usage", body_with(stream=True, stream_options={"include_usage": True}),
     "stream_options"),
    ("stream_options a string", body_with(stream_options="usage"), "stream_options"),
]
