#!/usr/bin/env python3
"""Structured outputs against a running `strata serve --http-listen`, with OpenAI's
official client and the `jsonschema` validator (neither written by this project).

- `chat.completions.parse` with a Pydantic model: the reply parses into the model.
- 120 generated JSON schemas (objects, arrays, enums, consts, anyOf, $defs/$ref, bounded
  integers and strings), each sent with a sampling seed through one of the spellings
  (`response_format`, `guided_json`, `structured_outputs`): every output must validate.
  The weights are random, so only the constraint makes the output valid.
- `guided_choice`, `guided_regex`, `json_object`.
- Hostile or unenforceable constraints: a 400 naming the field, within a time limit.

Usage: structured_outputs.py BASE_URL MODEL API_KEY
Exits non-zero with the reason on the first failure; prints "N passed" at the end.
"""
import json
import random
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
from pydantic import BaseModel, Field

from checks import PASSED, check

SCHEMAS = 120
HOSTILE_SECONDS = 10


def leaf(rng):
    kind = rng.randrange(7)
    if kind == 0:
        lo = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randrange(1, 500)}
    if kind == 1:
        return {"type": "string", "maxLength": rng.randrange(0, 7)}
    if kind == 2:
        return {"type": "string", "pattern": "^[a-z]{1,4}$"}
    if kind == 3:
        return {"enum": rng.sample(["a", "bb", "c c", 1, 2.5, True, None, "é"], rng.randrange(1, 4))}
    if kind == 4:
        return {"const": rng.choice(["x", 7, False, None])}
    if kind == 5:
        return {"type": "boolean"}
    return {"type": "null"}


def schema(rng, depth, defs):
    """A random schema; `$ref`s point into `defs`, which the caller puts at the root."""
    if depth == 0 or rng.random() < 0.3:
        return leaf(rng)
    kind = rng.randrange(4)
    if kind == 0:
        names = rng.sample(["id", "name", "tags", "ok", "a_b", "x1", "z"], rng.randrange(1, 4))
        props = {n: schema(rng, depth - 1, defs) for n in names}
        required = [n for n in names if rng.random() < 0.7]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    if kind == 1:
        lo = rng.randrange(0, 2)
        return {"type": "array", "items": schema(rng, depth - 1, defs), "minItems": lo, "maxItems": lo + rng.randrange(0, 3)}
    if kind == 2:
        return {"anyOf": [schema(rng, depth - 1, defs), schema(rng, depth - 1, defs)]}
    name = "d%d" % len(defs)
    defs[name] = schema(rng, depth - 1, defs)
    return {"type": "array", "items": {"$ref": "#/$defs/" + name}, "maxItems": 2}


def root_schema(rng):
    defs = {}
    s = schema(rng, 3, defs)
    if defs:
        s["$defs"] = defs
    return s


def hostile():
    deep = {"type": "integer"}
    for _ in range(400):
        deep = {"type": "array", "items": deep}
    huge_enum = {"enum": ["v%d" % i for i in range(20000)]}
    return [
        ("guided_json", {"type": "object", "oneOf": [{"type": "object"}, {"type": "object"}]}),
        ("guided_json", {"$ref": "#/$defs/missing"}),
        ("guided_json", {"type": "string", "pattern": "("}),
        ("guided_json", huge_enum),
        ("guided_regex", "(a|aa)*" * 4 + "["),
        ("guided_grammar", "start: undefined_rule"),
        ("response_format", deep),
    ]


def slow_but_valid():
    """Constraints built to be expensive that are still well-formed: served or refused,
    but within the time limit either way."""
    return [
        ("guided_grammar", "start: start start |"),
        ("guided_regex", "((a?){20}a{20}){10}"),
        ("guided_json", {"type": "string", "pattern": "(a|aa)*(a|aa)*(a|aa)*b{200}"}),
        ("guided_json", {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 5000}),
    ]


def main():
    base_url, model, key = sys.argv[1], sys.argv[2], sys.argv[3]
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Describe a thing as JSON."}]

    class Thing(BaseModel):
        name: str = Field(max_length=6)
        count: int = Field(ge=0, le=100)
        color: Literal["red", "green", "blue"]
        tags: list[Literal["a", "b"]] = Field(max_length=2)

    @check("chat.completions.parse with a Pydantic model")
    def _():
        for seed in range(4):
            r = client.chat.completions.parse(
                model=model, messages=messages, response_format=Thing, max_tokens=200, temperature=1.0, seed=seed
            )
            m = r.choices[0].message
            assert r.choices[0].finish_reason == "stop", r
            assert isinstance(m.parsed, Thing), m
            assert 0 <= m.parsed.count <= 100 and len(m.parsed.name) <= 6, m.parsed

    @check("json_object and json_schema without a schema")
    def _():
        for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "any"}}):
            r = client.chat.completions.create(
                model=model, messages=messages, response_format=fmt, max_tokens=40, temperature=0
            )
            text = r.choices[0].message.content
            assert text.startswith("{"), text
            if r.choices[0].finish_reason == "stop":
                assert isinstance(json.loads(text), dict), text

    @check("guided_choice and guided_regex")
    def _():
        for seed in range(6):
            r = client.completions.create(
                model=model, prompt="Pick:", max_tokens=20, temperature=1.0, seed=seed,
                extra_body={"guided_choice": ["alpha", "beta", "gamma delta"]},
            )
            assert r.choices[0].text in ("alpha", "beta", "gamma delta"), r.choices[0].text
            r = client.completions.create(
                model=model, prompt="Date:", max_tokens=20, temperature=1.0, seed=seed,
                extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"},
            )
            assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", r.choices[0].text), r.choices[0].text

    @check("%d generated schemas, every output valid" % SCHEMAS)
    def _():
        rng = random.Random(20261206)
        cases = [(i, root_schema(rng)) for i in range(SCHEMAS)]

        def one(case):
            i, s = case
            spelling = i % 3
            if spelling == 0:
                r = client.chat.completions.create(
                    model=model, messages=messages, max_tokens=400, temperature=1.0, seed=i,
                    response_format={"type": "json_schema", "json_schema": {"name": "s%d" % i, "schema": s, "strict": True}},
                )
                text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            else:
                extra = {"guided_json": s} if spelling == 1 else {"structured_outputs": {"json": s}}
                r = client.completions.create(
                    model=model, prompt="JSON:", max_tokens=400, temperature=1.0, seed=i, extra_body=extra
                )
                text, finish = r.choices[0].text, r.choices[0].finish_reason
            assert finish == "stop", (i, s, text, finish)
            try:
                jsonschema.validate(json.loads(text), s)
            except Exception as e:
                raise AssertionError((i, s, text, e))
            return text

        with ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(one, cases))
        assert len(set(outputs)) > SCHEMAS // 2, "outputs should differ across schemas and seeds"

    @check("hostile constraints get a 400 naming the field, quickly")
    def _():
        for field, spec in hostile():
            if field == "response_format":
                extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": spec}}}
            else:
                extra = {field: spec}
            started = time.monotonic()
            try:
                client.completions.create(model=model, prompt="x", max_tokens=50, extra_body=extra)
            except openai.BadRequestError as e:
                took = time.monotonic() - started
                assert took < HOSTILE_SECONDS, (field, took)
                body = e.body if isinstance(e.body, dict) else {}
                assert body.get("param") in (field, "body"), (field, e.body)
            else:
                raise AssertionError("%s was accepted: %s" % (field, json.dumps(spec)[:200]))

    @check("expensive but well-formed constraints answer within the limit")
    def _():
        for field, spec in slow_but_valid():
            started = time.monotonic()
            try:
                client.completions.create(model=model, prompt="x", max_tokens=20, extra_body={field: spec})
            except openai.BadRequestError as e:
                assert e.body.get("param") == field, e.body
            took = time.monotonic() - started
            assert took < HOSTILE_SECONDS, (field, spec, took)

    @check("a streamed request the replica refuses is a 400 too, not a failing stream")
    def _():
        for create in (
            lambda: client.completions.create(model=model, prompt="x", max_tokens=5, stream=True,
                                              extra_body={"guided_regex": "(unclosed"}),
            lambda: client.chat.completions.create(model=model, messages=messages, max_tokens=5, stream=True,
                                                   extra_body={"guided_grammar": "start: missing_rule"}),
        ):
            try:
                for _ in create():
                    pass
            except openai.BadRequestError as e:
                assert e.body.get("param") in ("guided_regex", "guided_grammar"), e.body
            else:
                raise AssertionError("the stream was accepted")

    @check("two ways of constraining at once are refused")
    def _():
        try:
            client.completions.create(
                model=model, prompt="x", max_tokens=5,
                extra_body={"guided_regex": "a", "response_format": {"type": "json_object"}},
            )
        except openai.BadRequestError as e:
            assert e.body.get("param") == "guided_regex", e.body
        else:
            raise AssertionError("accepted")

    print("%d passed" % len(PASSED))


if __name__ == "__main__":
    main()
