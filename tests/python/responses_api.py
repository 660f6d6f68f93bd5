#!/usr/bin/env python3
"""OpenAI's Python client against `strata serve`'s /v1/responses: plain text, streamed
events (the client's own types), function tools with tool_choice required and named
(arguments validated against their schemas), a function_call_output turn, structured
output through text.format, and previous_response_id continuing a stored conversation.

Usage: responses_api.py BASE_URL MODEL API_KEY
"""
import json
import sys

import jsonschema
import openai

from checks import PASSED, check


WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER, "strict": True}]


def main():
    base_url, model, key = sys.argv[1], sys.argv[2], sys.argv[3]
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)

    @check("plain text, unstreamed and streamed alike")
    def _():
        r = client.responses.create(model=model, input="Hello", instructions="Be brief.", max_output_tokens=10, temperature=0)
        assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete"), r
        assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0, r.usage
        text = r.output_text
        kinds, deltas, final = [], "", None
        for ev in client.responses.create(model=model, input="Hello", instructions="Be brief.", max_output_tokens=10,
                                          temperature=0, stream=True):
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas += ev.delta
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds
        assert "response.output_item.added" in kinds and "response.output_item.done" in kinds, kinds
        assert deltas == text and final.output_text == text, (deltas, text)
        seqs = [k for k in kinds]
        assert len(seqs) == len(kinds)

    @check("function tools: required and named, streamed too")
    def _():
        for choice in ("required", {"type": "function", "name": "get_weather"}):
            kw = dict(model=model, input="Weather in Oslo?", tools=TOOLS, tool_choice=choice,
                      parallel_tool_calls=False, max_output_tokens=100, temperature=0)
            r = client.responses.create(**kw)
            calls = [o for o in r.output if o.type == "function_call"]
            assert len(calls) == 1 and calls[0].name == "get_weather", r.output
            jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
            args, done = "", None
            for ev in client.responses.create(stream=True, **kw):
                if ev.type == "response.function_call_arguments.delta":
                    args += ev.delta
                if ev.type == "response.completed":
                    done = ev.response
            s_calls = [o for o in done.output if o.type == "function_call"]
            assert args == calls[0].arguments and s_calls[0].arguments == args, (args, calls[0].arguments)

    @check("a function_call_output turn and previous_response_id")
    def _():
        first = client.responses.create(model=model, input="Weather in Oslo?", tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_output_tokens=100, temperature=0)
        call = [o for o in first.output if o.type == "function_call"][0]
        turn = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
        follow = client.responses.create(
            model=model, previous_response_id=first.id, max_output_tokens=5, temperature=0, input=turn,
        )
        assert follow.previous_response_id == first.id and follow.status in ("completed", "incomplete"), follow
        # The stored conversation is in the prompt: more input tokens than the turn alone.
        alone = client.responses.create(model=model, max_output_tokens=5, temperature=0, input=turn)
        assert follow.usage.input_tokens > alone.usage.input_tokens + 5, (follow.usage, alone.usage)
        try:
            client.responses.create(model=model, previous_response_id="resp_missing", input="x", max_output_tokens=2)
        except openai.NotFoundError:
            pass
        else:
            raise AssertionError("an unknown previous_response_id was accepted")

    @check("structured output through text.format")
    def _():
        fmt = {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}
        r = client.responses.create(model=model, input="Weather?", text={"format": fmt}, max_output_tokens=100,
                                    temperature=1.0)
        jsonschema.validate(json.loads(r.output_text), WEATHER)

    @check("unknown parameters and tools are 400s naming them")
    def _():
        for kw, param in [
            (dict(extra_body={"frobnicate": 1}), "frobnicate"),
            (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
        ]:
            try:
                client.responses.create(model=model, input="x", max_output_tokens=2, **kw)
            except openai.BadRequestError as e:
                assert e.body.get("param") == param, e.body
            else:
                raise AssertionError("accepted: %s" % kw)

    print("%d passed" % len(PASSED))


if __name__ == "__main__":
    main()
