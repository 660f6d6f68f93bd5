#!/usr/bin/env python3
"""Calls a running `strata serve --http-listen` with OpenAI's official Python client
(sync and async): completions, chat completions, streaming with usage, n > 1, stop
sequences, logprobs, seeds, and errors raised as the client's own exception classes.

Usage: openai_client.py BASE_URL MODEL API_KEY EXPECTED_JSON
EXPECTED_JSON: {"prompt": text, "greedy": the gRPC API's greedy text for it (8 tokens)}.
Exits non-zero (with the reason) on the first mismatch; prints "N passed" at the end.
"""
import asyncio
import io
import json
import sys
import time

import openai

from checks import PASSED, check


def main():
    base_url, model, key, expected = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
    prompt, greedy = expected["prompt"], expected["greedy"]
    greedy_args = dict(model=model, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})

    @check("models")
    def _():
        ids = [m.id for m in client.models.list().data]
        assert model in ids, ids
        assert client.models.retrieve(model).id == model

    @check("completion equals gRPC")
    def _():
        r = client.completions.create(prompt=prompt, **greedy_args)
        assert r.object == "text_completion", r
        assert r.choices[0].text == greedy, (r.choices[0].text, greedy)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0, r.usage
        assert r.usage.total_tokens == r.usage.prompt_tokens + 8
        assert r.system_fingerprint == "r1", r.system_fingerprint  # the model revision

    @check("streamed completion with usage")
    def _():
        chunks = list(client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True}, **greedy_args))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == greedy, (text, greedy)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8, chunks[-1]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert {c.system_fingerprint for c in chunks if c.choices and c.choices[0].text} == {"r1"}

    @check("chat completion, unary and streamed")
    def _():
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
        r = client.chat.completions.create(messages=messages, **greedy_args)
        assert r.object == "chat.completion"
        content = r.choices[0].message.content
        assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 8, r
        stream = client.chat.completions.create(messages=messages, stream=True, stream_options={"include_usage": True}, **greedy_args)
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
        assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens

    @check("n > 1 with a seed is reproducible")
    def _():
        args = dict(model=model, prompt=prompt, max_tokens=6, n=3, seed=1234, temperature=1.0)
        a = client.completions.create(**args)
        b = client.completions.create(**args)
        ta, tb = [c.text for c in a.choices], [c.text for c in b.choices]
        assert [c.index for c in a.choices] == [0, 1, 2]
        assert ta == tb, (ta, tb)
        assert len(set(ta)) > 1, f"three seeded choices should differ: {ta}"
        assert a.usage.completion_tokens == 18

    @check("stop sequences")
    def _():
        cut = len(greedy) // 2
        stop = greedy[cut:cut + 2]
        if not stop.strip():
            stop = greedy[-2:]
        r = client.completions.create(prompt=prompt, stop=[stop], **greedy_args)
        want = greedy[:greedy.index(stop)]
        assert r.choices[0].text == want, (r.choices[0].text, want, stop)
        assert r.choices[0].finish_reason == "stop"

    @check("logprobs")
    def _():
        r = client.completions.create(prompt=prompt, logprobs=2, **greedy_args)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == 8 and len(lp.token_logprobs) == 8 and len(lp.text_offset) == 8, lp
        assert all(x <= 0 for x in lp.token_logprobs)
        assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
        # Greedy: the chosen token is the most likely one.
        assert all(abs(max(t.values()) - p) < 1e-4 for t, p in zip(lp.top_logprobs, lp.token_logprobs))
        c = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3, **greedy_args)
        content = c.choices[0].logprobs.content
        assert len(content) == 8 and all(len(t.top_logprobs) == 3 for t in content), content
        assert all(bytes(t.bytes) == t.token.encode("utf-8") for t in content)

    @check("errors raise the client's exceptions")
    def _():
        try:
            client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
            raise AssertionError("unknown model accepted")
        except openai.NotFoundError as e:
            assert e.status_code == 404 and "no-such-model" in e.message, e
        for bad, param in [({"max_tokens": 0}, "max_tokens"), ({"temperature": 5}, "temperature"), ({"n": 0}, "n"), ({"top_logprobs": 2}, "top_logprobs")]:
            try:
                client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], **bad)
                raise AssertionError(f"{bad} accepted")
            except openai.BadRequestError as e:
                assert e.status_code == 400 and e.body["param"] == param, (bad, e.body)
        try:
            client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "x"}])
            raise AssertionError("bad role accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "messages[0].role", e.body
        # (A missing key the client refuses to send; the Rust test sends none.)
        bad_client = openai.OpenAI(base_url=base_url, api_key="not-the-key", max_retries=0)
        try:
            bad_client.models.list()
            raise AssertionError("bad key accepted")
        except openai.AuthenticationError as e:
            assert e.status_code == 401

    @check("batch API end to end")
    def _():
        def line(i, **body):
            return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}})
        lines = [line(i) for i in range(12)] + [line(12, max_tokens=0)]
        f = client.files.create(file=("requests.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
        assert f.purpose == "batch" and f.bytes > 0 and client.files.retrieve(f.id).id == f.id
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h", metadata={"run": "test"})
        assert b.status in ("validating", "in_progress", "completed"), b.status
        deadline = time.time() + 60
        while b.status not in ("completed", "failed", "cancelled"):
            assert time.time() < deadline, b
            time.sleep(0.1)
            b = client.batches.retrieve(b.id)
        assert b.status == "completed" and b.metadata == {"run": "test"}, b
        assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (13, 12, 1), b.request_counts
        out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(12))
        assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["choices"][0]["text"] == greedy for o in out)
        errs = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
        assert [(e["custom_id"], e["response"]["status_code"]) for e in errs] == [("req-12", 400)], errs
        assert b.id in [x.id for x in client.batches.list().data]
        # Cancel: a long batch stops early and ends cancelled, its results so far kept.
        long = [line(i, max_tokens=200) for i in range(400)]
        f2 = client.files.create(file=("long.jsonl", io.BytesIO("\n".join(long).encode())), purpose="batch")
        b2 = client.batches.create(input_file_id=f2.id, endpoint="/v1/completions", completion_window="24h")
        b2 = client.batches.cancel(b2.id)
        assert b2.status in ("cancelling", "cancelled"), b2.status
        while b2.status == "cancelling":
            assert time.time() < deadline + 60, b2
            time.sleep(0.1)
            b2 = client.batches.retrieve(b2.id)
        assert b2.status == "cancelled" and b2.request_counts.completed < 400, b2
        try:
            client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
            raise AssertionError("a batch over no file was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "input_file_id", e.body

    async def run_async():
        ac = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
        results = await asyncio.gather(*[ac.completions.create(prompt=prompt, **greedy_args) for _ in range(6)])
        assert all(r.choices[0].text == greedy for r in results), [r.choices[0].text for r in results]
        stream = await ac.chat.completions.create(messages=[{"role": "user", "content": "hi"}], stream=True, **greedy_args)
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert len(pieces) >= 2
        await ac.close()

    asyncio.run(run_async())
    PASSED.append("async client")
    print(f"{len(PASSED)} passed: {', '.join(PASSED)}")


if __name__ == "__main__":
    main()
