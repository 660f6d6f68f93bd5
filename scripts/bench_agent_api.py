#!/usr/bin/env python3
"""The measurements of scripts/bench_agent_api.sh against a running server (BASE_URL,
model "m"); prints one JSON object of medians and ratios."""
import asyncio
import json
import os
import statistics
import sys
import time

import httpx2 as httpx

BASE = sys.argv[1]
STREAMS, TOKENS = 32, 64
TEMPERATURE = float(os.environ.get("TEMPERATURE", "1.0"))
# A tool call whose arguments cannot end within TOKENS tokens (300 readings), so both runs
# produce exactly STREAMS x TOKENS tokens and the throughputs compare like for like.
LONG_CALL = {
    "type": "object",
    "properties": {
        "station": {"type": "string", "maxLength": 40},
        "readings": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 300},
    },
    "required": ["station", "readings"],
    "additionalProperties": False,
}
# A typical tool's parameters, for the compile latency.
TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "notes": {"type": "string", "maxLength": 400},
    },
    "required": ["location", "unit", "days", "notes"],
    "additionalProperties": False,
}


async def throughput(client, constrained):
    async def one(i):
        body = {"model": "m", "prompt": "Weather report %d:" % i, "max_tokens": TOKENS, "temperature": TEMPERATURE,
                "seed": i, "ignore_eos": True, "cache": False}
        if constrained:
            body["guided_json"] = LONG_CALL
        r = await client.post(BASE + "/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]
    await one(0)  # warm (and, constrained, compile)
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(STREAMS))))
    return tokens / (time.perf_counter() - start), tokens


async def latency(client, path, body, n):
    times = []
    for i in range(n):
        b = body(i) if callable(body) else body
        start = time.perf_counter()
        r = await client.post(BASE + path, json=b)
        times.append(time.perf_counter() - start)
        r.raise_for_status()
    return statistics.median(times) * 1e3


async def main():
    async with httpx.AsyncClient(timeout=600) as client:
        # Alternating rounds (the first warms the KV cache's memory); medians of three.
        rounds = [(await throughput(client, False), await throughput(client, True)) for _ in range(3)]
        free_tps = statistics.median(r[0][0] for r in rounds)
        guided_tps = statistics.median(r[1][0] for r in rounds)
        free_tokens, guided_tokens = rounds[-1][0][1], rounds[-1][1][1]
        # Paired: each round sends the request plain, under a fresh schema (a compile) and
        # under a cached one; the medians of the differences are the compile's cost.
        one = {"model": "m", "prompt": "Hi", "max_tokens": 1, "temperature": 0, "cache": False}
        await latency(client, "/v1/completions", dict(one, guided_json=TOOL_SCHEMA), 1)
        fresh_d, cached_d, bases = [], [], []
        for i in range(60):
            schema = json.loads(json.dumps(TOOL_SCHEMA))
            schema["properties"]["field_%d" % i] = {"type": "boolean"}
            base = await latency(client, "/v1/completions", one, 1)
            fresh_d.append(await latency(client, "/v1/completions", dict(one, guided_json=schema), 1) - base)
            cached_d.append(await latency(client, "/v1/completions", dict(one, guided_json=TOOL_SCHEMA), 1) - base)
            bases.append(base)
        base, compile_d, cached_d = statistics.median(bases), statistics.median(fresh_d), statistics.median(cached_d)
        # Sampled without a seed: never answered from the response cache, on any route.
        # The routes take turns, so drift in the machine's speed falls on each alike.
        msgs = [{"role": "user", "content": "Hi"}]
        routes = [
            ("/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 1, "temperature": 1}),
            ("/v1/responses", {"model": "m", "input": msgs, "max_output_tokens": 1, "temperature": 1, "store": False}),
            ("/v1/messages", {"model": "m", "messages": msgs, "max_tokens": 1, "temperature": 1}),
        ]
        times = [[], [], []]
        for _ in range(60):
            for k, (path, body) in enumerate(routes):
                times[k].append(await latency(client, path, body, 1))
        chat, responses, messages = (statistics.median(t) for t in times)
    print(json.dumps({
        "streams": STREAMS,
        "unconstrained_tokens_per_s": round(free_tps, 1), "unconstrained_tokens": free_tokens,
        "constrained_tokens_per_s": round(guided_tps, 1), "constrained_tokens": guided_tokens,
        "constrained_ratio": round(guided_tps / free_tps, 3),
        "one_token_p50_ms": round(base, 2),
        "schema_compile_p50_ms": round(compile_d, 2),
        "schema_cache_hit_p50_ms": round(cached_d, 2),
        "chat_p50_ms": round(chat, 2),
        "responses_over_chat_p50_ms": round(responses - chat, 2),
        "messages_over_chat_p50_ms": round(messages - chat, 2),
    }, indent=1))


asyncio.run(main())
