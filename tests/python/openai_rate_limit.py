#!/usr/bin/env python3
"""A tenant over its request rate, as OpenAI's official Python client sees it: the
client raises RateLimitError (HTTP 429) whose response carries a Retry-After header, and
a call after waiting that long succeeds.

Usage: openai_rate_limit.py BASE_URL MODEL API_KEY
Prints "rate limit ok: retry-after N" on success; exits non-zero with the reason otherwise.
"""
import sys
import time

import openai


def main():
    base_url, model, key = sys.argv[1], sys.argv[2], sys.argv[3]
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
    args = dict(model=model, prompt="The quick brown fox", max_tokens=2, temperature=0,
                extra_body={"ignore_eos": True, "cache": False})
    limited = None
    for _ in range(20):
        try:
            client.completions.create(**args)
        except openai.RateLimitError as e:
            limited = e
            break
    assert limited is not None, "20 calls at once never hit the tenant's rate limit"
    assert limited.status_code == 429, limited.status_code
    body = limited.body or {}
    assert body.get("code") == "rate_limit_exceeded", body
    retry_after = limited.response.headers.get("retry-after")
    assert retry_after is not None and int(retry_after) >= 1, dict(limited.response.headers)
    time.sleep(int(retry_after))
    r = client.completions.create(**args)
    assert r.usage.completion_tokens == 2, r.usage
    print(f"rate limit ok: retry-after {retry_after}")


if __name__ == "__main__":
    main()
