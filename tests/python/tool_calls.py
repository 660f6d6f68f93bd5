#!/usr/bin/env python3
"""Tool calls against a running `strata serve --http-listen`, with OpenAI's client.

The model's chat template writes Hermes-style `<tool_call>` blocks, so `auto` reads that
format, and `<think>` blocks, so reasoning is separated into `reasoning_content`. With random weights a model never calls a tool by itself: `required` and named
functions are enforced by constrained decoding, and `auto` is driven by constraining the
reply (guided_regex) to a Hermes call, which the server must then parse like any reply.
Each is checked unstreamed and streamed; every call's arguments must validate against
the tool's schema (jsonschema).

Usage: tool_calls.py BASE_URL MODEL API_KEY
"""
import json
import sys

import jsonschema
import openai
from pydantic import BaseModel, Field

from checks import PASSED, check


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Rome", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


class Alarm(BaseModel):
    hour: int = Field(ge=0, le=23)
    label: str = Field(max_length=5)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
    openai.pydantic_function_tool(Alarm, name="set_alarm"),
]
SCHEMAS = {
    "get_weather": WEATHER,
    "now": {"type": "object", "properties": {}, "additionalProperties": False},
    "set_alarm": TOOLS[2]["function"]["parameters"],
}


def valid(call):
    args = json.loads(call["arguments"])
    jsonschema.validate(args, SCHEMAS[call["name"]])
    return call


def unstreamed(client, **kw):
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls or []]
    return c.message.content, calls, c.finish_reason


def streamed(client, **kw):
    content, calls, finish, arg_deltas = "", {}, None, 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            d = c.delta
            content += d.content or ""
            for t in d.tool_calls or []:
                if t.index not in calls:
                    assert t.id and t.function.name, t
                    calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": ""}
                if t.function and t.function.arguments:
                    calls[t.index]["arguments"] += t.function.arguments
                    arg_deltas += 1
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, arg_deltas


def main():
    base_url, model, key = sys.argv[1], sys.argv[2], sys.argv[3]
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    base = dict(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS, max_tokens=300)

    @check("named function, unstreamed and streamed")
    def _():
        for seed in range(3):
            for tool in ("get_weather", "set_alarm"):
                kw = dict(base, tool_choice={"type": "function", "function": {"name": tool}}, temperature=1.0, seed=seed)
                content, calls, finish = unstreamed(client, **kw)
                assert finish == "stop" and len(calls) == 1 and calls[0]["name"] == tool, (content, calls, finish)
                valid(calls[0])
                s_content, s_calls, s_finish, deltas = streamed(client, **kw)
                assert [(c["name"], c["arguments"]) for c in s_calls] == [(c["name"], c["arguments"]) for c in calls]
                assert s_finish == "stop" and deltas > 1, (s_calls, s_finish, deltas)

    @check("required, one call without parallel_tool_calls")
    def _():
        for seed in range(4):
            kw = dict(base, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed)
            content, calls, finish = unstreamed(client, **kw)
            assert finish == "tool_calls" and len(calls) == 1, (content, calls, finish)
            valid(calls[0])
            assert calls[0]["id"].startswith("call_")
            _, s_calls, s_finish, _ = streamed(client, **kw)
            assert [(c["name"], c["arguments"]) for c in s_calls] == [(c["name"], c["arguments"]) for c in calls]
            assert s_finish == "tool_calls"

    @check("required with parallel calls")
    def _():
        finished = 0
        for seed in range(6):
            kw = dict(base, tool_choice="required", temperature=1.0, seed=seed)
            content, calls, finish = unstreamed(client, **kw)
            if finish == "length":
                continue
            finished += 1
            assert finish == "tool_calls" and calls, (content, calls, finish)
            for c in calls:
                valid(c)
            assert len({c["id"] for c in calls}) == len(calls), "ids are unique"
        assert finished > 0, "some reply ends within max_tokens"

    @check("auto parses the model's own format")
    def _():
        call = '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "(Oslo|Rome)", "days": [1-7]\\}\\}\\n</tool_call>'
        kw = dict(base, tool_choice="auto", temperature=1.0, seed=1, extra_body={"guided_regex": "Checking\\. " + call})
        content, calls, finish = unstreamed(client, **kw)
        assert content == "Checking." and finish == "tool_calls" and len(calls) == 1, (content, calls, finish)
        valid(calls[0])
        s_content, s_calls, s_finish, deltas = streamed(client, **kw)
        assert s_content == content and s_finish == "tool_calls", (s_content, s_finish)
        assert [(c["name"], c["arguments"]) for c in s_calls] == [(c["name"], c["arguments"]) for c in calls]
        assert deltas > 1, "arguments streamed as generated"
        plain = dict(base, tool_choice="auto", temperature=0, max_tokens=10)
        content, calls, finish = unstreamed(client, **plain)
        assert calls == [] and isinstance(content, str), (content, calls)

    @check("reasoning is separated from the answer, streamed and not")
    def _():
        kw = dict(base, tools=None, temperature=1.0, seed=2, extra_body={"guided_regex": "<think>[a-z]{2,8}</think>(yes|no)"})
        kw = {k: v for k, v in kw.items() if v is not None}
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        reasoning = (m.model_extra or {}).get("reasoning_content")
        assert m.content in ("yes", "no") and reasoning and reasoning.isalpha(), (m.content, m.model_extra)
        content, thought = "", ""
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                content += c.delta.content or ""
                thought += (c.delta.model_extra or {}).get("reasoning_content") or ""
        assert (content, thought) == (m.content, reasoning), (content, thought)

    @check("tool_choice none reads no calls")
    def _():
        content, calls, _ = unstreamed(client, **dict(base, tool_choice="none", max_tokens=8, temperature=0))
        assert calls == [] and isinstance(content, str)

    @check("bad tool requests are 400s naming the field")
    def _():
        for kw, param in [
            (dict(base, tool_choice={"type": "function", "function": {"name": "missing"}}), "tool_choice"),
            (dict(base, tools=None, tool_choice="required"), "tool_choice"),
            (dict(base, tool_choice="sometimes"), "tool_choice"),
            (dict(base, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        ]:
            kw = {k: v for k, v in kw.items() if v is not None}
            try:
                client.chat.completions.create(**kw)
            except openai.BadRequestError as e:
                assert e.body.get("param") == param, (kw.get("tool_choice"), e.body)
            else:
                raise AssertionError("accepted: %s" % kw.get("tool_choice"))

    print("%d passed" % len(PASSED))


if __name__ == "__main__":
    main()
