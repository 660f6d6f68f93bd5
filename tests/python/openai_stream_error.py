#!/usr/bin/env python3
"""Streams a long chat completion with OpenAI's client; prints "started" after the first
token, then keeps reading. When the server reports an error mid-stream, the client must
raise its APIError: prints {"raised": class name, "message": ...} as JSON.

Usage: openai_stream_error.py BASE_URL MODEL
"""
import json
import sys

import openai


def main():
    client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=sys.argv[2], messages=[{"role": "user", "content": "go"}], max_tokens=1500,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    try:
        announced = False
        for chunk in stream:
            if not announced and chunk.choices and chunk.choices[0].delta.content:
                print("started", flush=True)
                announced = True
        print(json.dumps({"raised": None}), flush=True)
    except openai.APIError as e:
        print(json.dumps({"raised": type(e).__name__, "message": e.message}), flush=True)


if __name__ == "__main__":
    main()
