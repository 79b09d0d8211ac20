"""`tpweave bench serve --backend openai`: the in-process client's trace (the same requests, arrival times and prompt
token ids as bench/serve.py's run_requests) sent to any OpenAI-compatible server over HTTP, streamed
(/v1/completions with `stream: true`), with TTFT and inter-token latency measured at the client: a token's time is
the arrival of the server-sent event that carried it. The records are run_requests' own, so summarize() and
serve_rows() give the same metrics for both clients.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from tpweave.bench.serve import Request


def trace_prompts(requests: list[Request], vocab_size: int, seed: int) -> list[list[int]]:
    """The prompt token ids run_requests draws for these requests with this seed (arrival order)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(vocab_size) for _ in range(r.input_len)] for r in sorted(requests, key=lambda r: r.arrival_s)
    ]


async def _send(session, url: str, body: dict, rec: dict, t0: float) -> None:
    """POST one streamed completion; fill rec's token_times (seconds since t0) or its error."""
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                rec["error"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            usage_tokens = None
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec["error"] = str(chunk["error"].get("message", chunk["error"]))
                    return
                now = time.perf_counter() - t0
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids")
                    # servers without token ids in chunks: one token per chunk that carries text
                    n = len(ids) if ids is not None else int(bool(choice.get("text") or choice.get("delta")))
                    rec["token_times"] += [now] * n
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
            if usage_tokens is not None and usage_tokens > len(rec["token_times"]) and rec["token_times"]:
                rec["token_times"] += [rec["token_times"][-1]] * (usage_tokens - len(rec["token_times"]))
            if not rec["token_times"]:
                rec["error"] = "the stream ended without a token"
    except Exception as e:  # noqa: BLE001  (a connection error is this request's failure, not the run's)
        rec["error"] = f"{type(e).__name__}: {e}"


async def _run(base_url: str, model: str, requests: list[Request], prompts: list[list[int]], *, api_key: str | None,
               max_concurrency: int | None, timeout_s: float) -> list[dict[str, Any]]:  # fmt: skip
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    url = base_url.rstrip("/") + "/completions"
    records = [{"arrival_s": r.arrival_s, "input_len": r.input_len, "output_len": r.output_len, "token_times": [],
                "error": None} for r in sorted(requests, key=lambda r: r.arrival_s)]  # fmt: skip
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(rec: dict, prompt: list[int]) -> None:
            await asyncio.sleep(max(0.0, rec["arrival_s"] - (time.perf_counter() - t0)))
            body = {"model": model, "prompt": prompt, "max_tokens": rec["output_len"], "temperature": 0.0,
                    "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
            if limit is None:
                await _send(session, url, body, rec, t0)
            else:
                async with limit:
                    await _send(session, url, body, rec, t0)

        await asyncio.gather(*(one(rec, p) for rec, p in zip(records, prompts)))
    return records


def run_http_requests(base_url: str, model: str, requests: list[Request], *, vocab_size: int, seed: int,
                      api_key: str | None = None, max_concurrency: int | None = None,
                      timeout_s: float = 3600.0) -> list[dict[str, Any]]:  # fmt: skip
    """The trace through the server at base_url (e.g. http://127.0.0.1:8000/v1); one record per request."""
    prompts = trace_prompts(requests, vocab_size, seed)
    return asyncio.run(_run(base_url, model, requests, prompts, api_key=api_key, max_concurrency=max_concurrency,
                            timeout_s=timeout_s))  # fmt: skip


def served_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
    """The server's first model card (/v1/models); ValueError naming the URL when it does not answer."""
    import aiohttp

    async def get() -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.get(base_url.rstrip("/") + "/models") as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                return await resp.json()

    try:
        cards = asyncio.run(get()).get("data") or []
    except Exception as e:  # noqa: BLE001  (whatever kept the server from answering, named)
        raise ValueError(f"--base-url {base_url}: no model list at /models ({type(e).__name__}: {e})") from None
    if not cards:
        raise ValueError(f"--base-url {base_url}: the server lists no model")
    return cards[0]
