"""`tpweave serve` as its users meet it: a server process on 127.0.0.1 (TP 1 and 2 over gloo), reached through the
official `openai` client and raw HTTP. Greedy tokens equal `tpweave generate`'s; bad requests get OpenAI-style 400s
and the server keeps serving; a bounded load with disconnecting and malformed clients leaks no KV block; SIGTERM
drains and exits 0 with no rank process left; a rank that dies takes the server down with a message; `bench serve
--backend openai` runs its trace through it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

aiohttp = pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

from tpweave.runtime.launch import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

TINY = ["--model", "tiny", "--dtype", "float32", "--no-compile", "--max-model-len", "256", "--block-size", "4",
        "--num-gpu-blocks-override", "128", "--max-num-batched-tokens", "64", "--max-num-seqs", "16"]  # fmt: skip


class Server:
    """A `tpweave serve` process: its URL, its output so far, its rank processes."""

    def __init__(self, proc: subprocess.Popen, port: int):
        self.proc, self.port, self.lines = proc, port, []
        self.url = f"http://127.0.0.1:{port}"
        threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def ranks(self) -> list[int]:
        """Pids of the rank processes: the launching process's children but multiprocessing's resource tracker, and
        for its fork server the server's children (tpweave.launch forks ranks from it)."""
        ranks = []
        for pid in _children(self.proc.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"multiprocessing.forkserver" in cmdline:
                ranks += _children(pid)
            elif b"resource_tracker" not in cmdline:
                ranks.append(pid)
        return ranks

    def stop(self, timeout: float = 120) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


@contextmanager
def serving(*args: str, startup_s: float = 300):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tpweave", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    server = Server(proc, port)
    try:
        deadline = time.monotonic() + startup_s
        while "tpweave: serving" not in server.output:
            assert proc.poll() is None, f"the server exited ({proc.returncode}) before serving:\n{server.output}"
            assert time.monotonic() < deadline, f"not serving after {startup_s} s:\n{server.output}"
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _get(url: str, path: str, **headers) -> tuple[int, str]:
    async def go():
        async with aiohttp.ClientSession(headers=headers) as s, s.get(url + path) as r:
            return r.status, await r.text()

    return asyncio.run(go())


def _metric(url: str, name: str) -> float:
    _, text = _get(url, "/metrics")
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"tpweave:{name}{{")]
    assert len(values) == 1, (name, text[:2000])
    return values[0]


def _generated_ids(tp: int, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """`tpweave generate`'s greedy tokens for these prompts (the server's engine flags)."""
    args = ["generate", "--model", "tiny", "--dtype", "float32", "--no-compile", "-tp", str(tp), "--max-tokens",
            str(max_tokens), "--num-gpu-blocks-override", "128",
            "--block-size", "4", "--max-num-batched-tokens", "64"]  # fmt: skip
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    out = subprocess.run([sys.executable, "-m", "tpweave", *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("[")]
    return [json.loads(ln.split("-> ")[1].rsplit(" (", 1)[0]) for ln in lines]


def _hf_model_with_tokenizer(path: Path) -> Path:
    """A random 2-layer transformers Llama with a word-level tokenizer and a chat template, saved at path."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(100)] + ["user", "assistant", ":", "hello", "world"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}assistant :"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>", chat_template=template)  # fmt: skip
    fast.save_pretrained(path)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, pad_token_id=0, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_openai_client_completions_chat_streaming_and_errors(tmp_path):
    """TP=1, a model directory with a tokenizer: text and token-id completions, chat, streamed chat equal to the
    whole one, usage; greedy token ids equal the in-process engine's; each bad request a 400/401/404 naming its
    field, and the server still answers."""
    pytest.importorskip("transformers")
    import torch

    from tpweave.engine import LLMEngine, SamplingParams
    from tpweave.runtime.context import TPContext
    from tpweave.server import protocol

    path = _hf_model_with_tokenizer(tmp_path / "hf")
    flags = ["--model", str(path), "--dtype", "float32", "--no-compile", "--max-num-batched-tokens", "64",
             "--num-gpu-blocks-override", "128", "--served-model-name", "m", "--api-key", "sesame"]  # fmt: skip
    with serving(*flags) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["m"]
        done = client.completions.create(model="m", prompt="hello world w1 w2", max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})  # fmt: skip
        choice = done.choices[0]
        ids = choice.model_extra["token_ids"]
        assert len(ids) == 6 and done.usage.completion_tokens == 6 and done.usage.prompt_tokens == 4
        tok = __import__("transformers").AutoTokenizer.from_pretrained(path)
        assert choice.text == tok.decode(ids, skip_special_tokens=True)
        engine = LLMEngine(TPContext.single("cpu"), str(path), dtype=torch.float32, compile_model=False,
                           num_blocks=128, max_num_batched_tokens=64)  # fmt: skip
        alone = engine.generate([tok.encode("hello world w1 w2")], SamplingParams(max_tokens=6, logprobs=2))[0]
        expected = alone["token_ids"]
        assert ids == expected
        # logprobs: the engine's, each token's text, and the top 2 (the completions API's form)
        scored = client.completions.create(model="m", prompt="hello world w1 w2", max_tokens=6, temperature=0,
                                           logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
        lp, served = scored.choices[0].logprobs, protocol.ServedModel("m", 0, 0, tok)
        assert lp.token_logprobs == [x.logprob for x in alone["logprobs"]] and lp.tokens == [
            tok.decode([t]) for t in expected
        ]
        assert lp.top_logprobs == [protocol._by_text(served, x.top) for x in alone["logprobs"]]
        assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0]) and choice.logprobs is None
        stream = client.completions.create(model="m", prompt="hello world w1 w2", max_tokens=6, temperature=0,
                                           logprobs=2, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        parts = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
        assert [x for p in parts for x in p.text_offset] == lp.text_offset and len(parts) > 1
        assert [x for p in parts for x in p.token_logprobs] == lp.token_logprobs
        by_ids = client.completions.create(model="m", prompt=tok.encode("hello world w1 w2"), max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert by_ids.choices[0].model_extra["token_ids"] == expected
        messages = [{"role": "user", "content": "hello w3 w4"}]
        chat = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})  # fmt: skip
        stream = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})  # fmt: skip
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        # chat logprobs, whole and streamed: the same entries, each naming its token's id
        scored = client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=8,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            extra_body={"ignore_eos": True},
        )
        content = scored.choices[0].logprobs.content
        assert [e.model_extra["token_id"] for e in content] == scored.choices[0].model_extra["token_ids"]
        assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob for e in content)
        stream = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                                logprobs=True, top_logprobs=3, stream=True,
                                                extra_body={"ignore_eos": True})  # fmt: skip
        streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content] and len(content) == 8
        # bad requests: the error names the field; the server keeps serving
        bad = [
            (openai.BadRequestError, dict(prompt="hello", max_tokens=0), "max_tokens"),
            (openai.BadRequestError, dict(prompt=[5, 500], max_tokens=2), "prompt"),  # outside the vocabulary
            (openai.BadRequestError, dict(prompt="w1 " * 300, max_tokens=2), "prompt"),  # longer than the context
            (openai.BadRequestError, dict(prompt="hello", extra_body={"best_of_n": 3}), "best_of_n"),
            (openai.BadRequestError, dict(prompt="hello", logprobs=21), "logprobs"),
            (openai.BadRequestError, dict(prompt="hello", temperature=-1), "temperature"),
        ]
        for error, kwargs, param in bad:
            with pytest.raises(error) as e:
                client.completions.create(model="m", **kwargs)
            assert e.value.body["param"] == param, e.value.body
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="hello")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert _get(server.url, "/health") == (200, '{"status": "ok"}')
        assert server.stop() == 0, server.output


def test_serve_at_tp_2_matches_generate_and_frees_an_abandoned_stream():
    """TP=2 over gloo: greedy token ids, whole and streamed, equal `tpweave generate -tp 2`'s; a client that leaves
    mid-stream gets its KV blocks back on every rank; SIGTERM: exit 0, every rank's blocks free, no rank left."""
    prompts = [[1, 2, 3, 4], [7] * 30, [100, 200, 300]]
    expected = _generated_ids(2, prompts, 8)
    with serving(*TINY, "-tp", "2") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        ranks = server.ranks()
        assert len(ranks) >= 2
        for prompt, want in zip(prompts, expected):
            whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
            assert whole.choices[0].model_extra["token_ids"] == want
            chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True)
            streamed = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
            assert streamed == want
        total = _metric(server.url, "num_free_kv_blocks")
        stream = client.completions.create(model="tiny", prompt=[5] * 40, max_tokens=200, temperature=0, stream=True)
        next(iter(stream))
        assert _metric(server.url, "num_free_kv_blocks") < total  # held while it streams
        stream.close()  # the client leaves
        deadline = time.monotonic() + 30
        while _metric(server.url, "num_free_kv_blocks") < total:
            assert time.monotonic() < deadline, "the abandoned request's blocks were not freed"
            time.sleep(0.1)
        assert server.stop() == 0, server.output
    assert "KV blocks free at exit: rank 0: 128/128, rank 1: 128/128" in server.output, server.output
    assert not [p for p in ranks if Path(f"/proc/{p}").exists()], "a rank process outlived the server"


def test_a_rank_that_dies_takes_the_server_down_with_a_message():
    with serving(*TINY, "-tp", "2") as server:
        workers = server.ranks()
        os.kill(max(workers), signal.SIGKILL)  # the last child started: a rank
        assert server.proc.wait(120) == 1
    assert "tpweave: error: rank" in server.output and "killed by SIGKILL" in server.output, server.output


async def _load(url: str, n: int, concurrency: int, seed: int) -> dict[str, int]:
    """n requests, `concurrency` at a time: streamed and whole, 10% that leave mid-stream, 10% malformed. How each
    ended, by kind; AssertionError on an answer that does not fit its kind."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    ends: dict[str, int] = {}
    malformed = [b"{not json", json.dumps({"prompt": [1, 2], "max_tokens": 0}).encode(),
                 json.dumps({"prompt": [1] * 300}).encode(), json.dumps({"prompt": [99999]}).encode(),
                 json.dumps({"prompt": [1], "unknown": 1}).encode(), b"[1, 2]"]  # fmt: skip

    async def one(session, i: int) -> None:
        kind = rng.choices(["stream", "whole", "leave", "malformed"], [4, 4, 1, 1])[0]
        body = {"prompt": [rng.randrange(1536) for _ in range(rng.randint(1, 40))], "max_tokens": rng.randint(1, 24),
                "temperature": rng.choice([0.0, 0.8]), "seed": i, "stream": kind in ("stream", "leave")}  # fmt: skip
        data = rng.choice(malformed) if kind == "malformed" else json.dumps(body).encode()
        async with limit, session.post(url + "/v1/completions", data=data) as resp:
            if resp.status == 503:  # over --max-pending: refused, with an OpenAI error body
                assert (await resp.json())["error"]["type"] == "server_overloaded"
                ends["503"] = ends.get("503", 0) + 1
                return
            if kind == "malformed":
                assert resp.status == 400 and "message" in (await resp.json())["error"]
            elif kind == "whole":
                assert resp.status == 200 and (await resp.json())["choices"][0]["finish_reason"] == "length"
            elif kind == "stream":
                text = await resp.text()
                assert resp.status == 200 and text.endswith("data: [DONE]\n\n"), text[-300:]
            else:
                await resp.content.readline()  # the first event, then the client leaves
                resp.close()
            ends[kind] = ends.get(kind, 0) + 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(one(session, i) for i in range(n)))
    return ends


def test_bounded_load_with_leaving_and_malformed_clients_then_bench_then_sigterm(tmp_path):
    """200 requests, 32 at a time, on a server holding at most 24: every request answered (200, 400, or 503 over
    the limit) or left by its client; afterwards no KV block held, /health answers; then `bench serve --backend
    openai` through it; then SIGTERM: exit 0."""
    with serving(*TINY, "--max-pending", "24") as server:
        total = _metric(server.url, "num_free_kv_blocks")
        ends = asyncio.run(_load(server.url, 200, 32, seed=0))
        assert sum(ends.values()) == 200 and ends.get("leave") and ends.get("malformed") and ends.get("503"), ends
        deadline = time.monotonic() + 30
        while _metric(server.url, "num_free_kv_blocks") < total or _metric(server.url, "num_requests_running"):
            assert time.monotonic() < deadline, "KV blocks still held after the load"
            time.sleep(0.1)
        assert _get(server.url, "/health")[0] == 200
        bench = subprocess.run(
            [sys.executable, "-m", "tpweave", "bench", "serve", "--backend", "openai", "--base-url", server.url + "/v1",
             "--model", "tiny", "--workload", "sharegpt", "--request-rate", "inf,50", "--num-prompts", "12",
             "--rounds", "1", "--max-model-len", "256", "--output-dir", str(tmp_path), "--name", "http"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
        rows = json.loads((tmp_path / "http.json").read_text())["rows"]
        assert [r["num_finished"] for r in rows] == [12, 12] and all(r["ttft_ms_p50"] > 0 for r in rows)
        assert server.stop() == 0, server.output
    assert "KV blocks free at exit: rank 0: 128/128" in server.output


def test_the_readme_serve_example_is_a_valid_command_and_request():
    """The README's two serving lines: the `tpweave serve` flags parse, and the curl body is a request the server
    takes for that model (the running server is the other tests')."""
    import re
    import shlex

    from tpweave.cli.main import COMMANDS
    from tpweave.cli.parser import build_parser
    from tpweave.models import resolve_config
    from tpweave.server import protocol

    block = next(b for b in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S) if "serve" in b)
    serve_line, curl_line = block.strip().splitlines()
    argv = shlex.split(serve_line.split("&&", 1)[1].split("#", 1)[0])
    assert argv[0] == "tpweave"
    args = build_parser(COMMANDS).parse_args(argv[1:])
    body = json.loads(shlex.split(curl_line)[shlex.split(curl_line).index("-d") + 1])
    cfg = resolve_config(args.model)
    req = protocol.parse_request(body, "completion", protocol.ServedModel(args.model, cfg.vocab_size, 256))
    assert req.params.temperature == 0 and req.params.max_tokens == body["max_tokens"]
    assert f"--port {args.port}" in serve_line and f"localhost:{args.port}/v1/completions" in curl_line


def test_requests_the_engine_cannot_serve_are_refused_naming_the_field():
    from tpweave.server import protocol
    from tpweave.server.protocol import RequestError

    model = protocol.ServedModel("m", 100, 32)
    ok = {"prompt": [1, 2], "max_tokens": 3}
    assert protocol.parse_request(ok, "completion", model).prompts == [[1, 2]]
    assert protocol.parse_request({"prompt": [[1], [2, 3]]}, "completion", model).prompts == [[1], [2, 3]]
    refused = [
        ([1], "body"), ({**ok, "n": 2}, "n"), ({**ok, "stop": ["x"]}, "stop"), ({**ok, "top_p": 0}, "top_p"),
        ({**ok, "presence_penalty": 0.5}, "presence_penalty"), ({**ok, "seed": "1"}, "seed"),
        ({**ok, "stream": "yes"}, "stream"), ({**ok, "max_tokens": True}, "max_tokens"), ({"prompt": []}, "prompt"),
        ({"prompt": "text"}, "prompt"),  # no tokenizer: token ids only
        ({**ok, "stop_token_ids": "2"}, "stop_token_ids"), ({**ok, "stream_options": {"x": 1}}, "stream_options"),
        ({**ok, "logprobs": 21}, "logprobs"), ({**ok, "logprobs": True}, "logprobs"),
    ]  # fmt: skip
    for body, param in refused:
        with pytest.raises(RequestError) as e:
            protocol.parse_request(body, "completion", model)
        assert e.value.status == 400 and (e.value.param == param or param == "body"), (body, e.value.body())
    with pytest.raises(RequestError) as e:
        protocol.parse_request({"messages": [{"role": "user", "content": "hi"}]}, "chat", model)
    assert "chat template" in str(e.value)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for body, param in [({**chat, "top_logprobs": 2}, "top_logprobs"), ({**chat, "logprobs": 2}, "logprobs"),
                        ({**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs")]:  # fmt: skip
        with pytest.raises(RequestError) as e:
            protocol.parse_request(body, "chat", model)
        assert e.value.param == param, e.value.body()
    assert protocol.parse_request({**ok, "logprobs": 3}, "completion", model).params.logprobs == 3
    assert protocol.parse_request({**ok, "logprobs": 0}, "completion", model).params.logprobs == 0
    assert protocol.parse_request(ok, "completion", model).params.logprobs is None


def test_the_mailbox_wakes_the_event_loop_once_per_batch_and_keeps_order():
    """Events posted from another thread reach their queues in order; a batch posted before the loop runs costs one
    wake-up (call_soon_threadsafe), not one per event."""
    from tpweave.server.http import Mailbox

    loop = asyncio.new_event_loop()
    wakeups = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), real(*a))[1]
    queues = [asyncio.Queue() for _ in range(3)]
    mailbox = Mailbox(loop)

    def engine_thread(start: int) -> None:
        for n in range(start, start + 50):
            mailbox.post(queues[n % 3], n)

    for batch in range(2):  # two steps' events, the loop drained in between
        worker = threading.Thread(target=engine_thread, args=(batch * 50,))
        worker.start()
        worker.join()
        loop.run_until_complete(asyncio.sleep(0))
    got = [[q.get_nowait() for _ in range(q.qsize())] for q in queues]
    assert got == [[n for n in range(100) if n % 3 == k] for k in range(3)]
    assert len(wakeups) == 2
    loop.close()
