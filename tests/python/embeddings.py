#!/usr/bin/env python3
"""/v1/embeddings against a running `strata serve --http-listen`, with OpenAI's official
client (not written by this project), against the vectors HF transformers computes
(tests/fixtures/embeddings/reference.json: the base model's pooled `last_hidden_state`).

- `embeddings.create` as the client sends it (base64, decoded by the client) and as floats:
  the model's default pooling (DEFAULT, from its sentence-transformers config), normalized;
- token-id inputs, `pooling`/`normalize` overrides through `extra_body`;
- many inputs answered in order, with the prompt tokens counted;
- `dimensions` other than the model's width and an empty input: a 400 naming the field.

Usage: embeddings.py BASE_URL MODEL API_KEY REFERENCE CASE DEFAULT_POOLING
Exits non-zero with the reason on the first failure; prints "N passed" at the end.
"""
import json
import math
import pathlib
import sys

import openai

from checks import PASSED, check

TOLERANCE = 2e-4


def unit(v):
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]


def close(got, want, what):
    assert len(got) == len(want), f"{what}: {len(got)} values, HF has {len(want)}"
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert diff < TOLERANCE, f"{what}: differs from HF transformers by {diff}"


def main():
    base, model, key, reference, case, default = sys.argv[1:7]
    ref = json.loads(pathlib.Path(reference).read_text())
    texts, want = ref["texts"], ref[case]
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)

    @check("the client's default (base64) and floats: HF's vectors, pooled as the model says, normalized")
    def _():
        for fmt in [openai.NOT_GIVEN, "float"]:
            r = client.embeddings.create(model=model, input=texts, encoding_format=fmt)
            assert [d.index for d in r.data] == list(range(len(texts)))
            for i, d in enumerate(r.data):
                close(d.embedding, unit(want[default][i]), f"text {i} ({fmt})")
            assert r.usage.prompt_tokens == sum(len(ids) for ids in want["ids"]), r.usage

    @check("token ids in, and pooling and normalize chosen by the caller")
    def _():
        for pooling in ["last", "mean", "cls"]:
            r = client.embeddings.create(
                model=model, input=want["ids"], encoding_format="float",
                extra_body={"pooling": pooling, "normalize": False},
            )
            for i, d in enumerate(r.data):
                close(d.embedding, want[pooling][i], f"{pooling} of ids {i}")

    @check("many inputs: answered in order")
    def _():
        many = [texts[i % len(texts)] for i in range(150)]
        r = client.embeddings.create(model=model, input=many, encoding_format="float")
        assert len(r.data) == 150
        for i, d in enumerate(r.data):
            assert d.index == i
            close(d.embedding, unit(want[default][i % len(texts)]), f"input {i}")

    @check("bad requests: 400 naming the field")
    def _():
        for kwargs, param in [
            ({"input": "x", "dimensions": 3}, "dimensions"),
            ({"input": ""}, "input"),
            ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
            ({"input": "x", "extra_body": {"pooling": "max"}}, "pooling"),
        ]:
            try:
                client.embeddings.create(model=model, **kwargs)
            except openai.BadRequestError as e:
                assert e.body.get("param") == param, (kwargs, e.body)
            else:
                raise AssertionError(f"{kwargs} was accepted")

    print(f"{len(PASSED)} passed")


if __name__ == "__main__":
    main()
