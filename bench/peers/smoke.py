"""One streamed, greedy /v1/chat/completions against a peer (or tokenfleet).

Run with the project's venv (it has the official `openai` client):

    .venv/bin/python bench/peers/smoke.py PORT [--model smollm2-135m-instruct] [--max-tokens 16]

Prints the generated text, time to first token and total time as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

from openai import OpenAI

PROMPT = "What is the capital of France? Answer in one sentence."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("port", type=int)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt", default=PROMPT)
    args = ap.parse_args()

    client = OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", timeout=300)
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    chunks = 0
    finish = None
    stream = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": args.prompt}],
        max_tokens=args.max_tokens,
        temperature=0.0,
        stream=True,
    )
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta.content or ""
        if delta:
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(delta)
            chunks += 1
        if choice.finish_reason:
            finish = choice.finish_reason
    total = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "port": args.port,
                "model": args.model,
                "text": "".join(parts),
                "content_chunks": chunks,
                "finish_reason": finish,
                "ttft_s": round(ttft, 4) if ttft is not None else None,
                "total_s": round(total, 4),
            },
            ensure_ascii=False,
        )
    )
    return 0 if parts else 1


if __name__ == "__main__":
    raise SystemExit(main())
