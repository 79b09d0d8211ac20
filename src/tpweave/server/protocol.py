"""The OpenAI API's request and response bodies for `tpweave serve`: parsing a request into prompts and the engine's
SamplingParams (refusing what the engine cannot do, naming the field), and building the responses, whole or as
server-sent-event chunks. No HTTP here (server/http.py)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tpweave.engine import MAX_LOGPROBS, SamplingParams, TokenLogprobs

# fields each endpoint takes; any other is refused (a silently ignored option gives the user other results than asked)
COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "seed", "stream", "stream_options", "stop_token_ids", "n",
    "ignore_eos", "user", "logprobs", "stop", "presence_penalty", "frequency_penalty",
}  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}


class RequestError(ValueError):
    """A request the server refuses: an HTTP status and an OpenAI-style error body naming the field."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, kind: str | None = None):
        super().__init__(message)
        self.param, self.status = param, status
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             503: "server_overloaded"}.get(status, "server_error")  # fmt: skip

    def body(self) -> dict[str, Any]:
        """The error body of the response."""
        return error_body(str(self), kind=self.kind, param=self.param, code=self.status)


def error_body(message: str, *, kind: str, param: str | None = None, code: int | None = None) -> dict[str, Any]:
    """{"error": {...}} as the OpenAI API returns it."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class ServedModel:
    """What a request is checked against: the name clients send as `model`, the vocabulary, the context length, a
    tokenizer (None: prompts as token ids only) and its end-of-sequence ids (stop tokens unless ignore_eos)."""

    name: str
    vocab_size: int
    max_model_len: int
    tokenizer: Any = None
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class ParsedRequest:
    """One HTTP request: its prompts (token ids; several for a completions request with a list of prompts), the
    engine's sampling parameters, and how to answer."""

    kind: str  # "completion" or "chat"
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _number(body: dict, name: str, kind: type, default, *, lo=None, hi=None, lo_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, kind) if kind is int else isinstance(value, int | float)
    if isinstance(value, bool) or not ok:
        raise RequestError(f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=name)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise RequestError(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {value}", param=name)
    if hi is not None and value > hi:
        raise RequestError(f"'{name}' must be <= {hi}, got {value}", param=name)
    return kind(value)


def _token_ids(value: Any, model: ServedModel, param: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value):  # fmt: skip
        raise RequestError(f"'{param}' must be a non-empty list of token ids", param=param)
    bad = [t for t in value if not 0 <= t < model.vocab_size]
    if bad:
        raise RequestError(f"token ids {bad[:4]} in '{param}' are outside the vocabulary [0, {model.vocab_size})",
                           param=param)  # fmt: skip
    return list(value)


def _encode(text: str, model: ServedModel, param: str) -> list[int]:
    if model.tokenizer is None:
        raise RequestError(f"'{param}' is text, but model {model.name} has no tokenizer: send token ids", param=param)
    ids = model.tokenizer.encode(text)
    if not ids:
        raise RequestError(f"'{param}' encodes to no tokens", param=param)
    return ids


def _prompts(body: dict, model: ServedModel) -> list[list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [_encode(prompt, model, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [_token_ids(prompt, model, "prompt")]
    if isinstance(prompt, list) and prompt:
        out = []
        for i, p in enumerate(prompt):
            out.append(
                _encode(p, model, f"prompt[{i}]") if isinstance(p, str) else _token_ids(p, model, f"prompt[{i}]")
            )
        return out
    raise RequestError("'prompt' must be a string, a list of token ids, or a list of either", param="prompt")


def _chat_prompt(body: dict, model: ServedModel) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RequestError(f"'messages[{i}]' needs a string 'role' and a string 'content'", param="messages")
    tok = model.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise RequestError(f"model {model.name} has no tokenizer with a chat template: use /v1/completions with "
                           "token ids", param="messages")  # fmt: skip
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(ids, "keys"):  # a BatchEncoding all the same
        ids = ids["input_ids"]
    return _token_ids(list(ids), model, "messages")


def _logprobs(body: dict, kind: str) -> int | None:
    """The most likely tokens each generated token reports besides its own logprob (None: no logprobs): completions
    take `logprobs` (an integer), chat `logprobs` (true or false) and `top_logprobs` (an integer, with logprobs)."""
    if kind == "completion":
        if body.get("logprobs") is False:
            return None
        return _number(body, "logprobs", int, None, lo=0, hi=MAX_LOGPROBS)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise RequestError(f"'logprobs' must be true or false, got {wanted!r}", param="logprobs")
    top = _number(body, "top_logprobs", int, None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not wanted:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def parse_request(body: Any, kind: str, model: ServedModel) -> ParsedRequest:
    """A completions (`kind` "completion") or chat completions ("chat") body, checked; RequestError names the first
    field that is wrong."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    allowed = COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        names = ", ".join(map(repr, unknown))
        raise RequestError(f"unknown field(s) {names}: tpweave takes {', '.join(sorted(allowed))}", param=unknown[0])
    name = body.get("model")
    if name is not None and name != model.name:
        raise RequestError(f"the model {name!r} does not exist; this server serves {model.name!r}", param="model",
                           status=404)  # fmt: skip
    if _number(body, "n", int, 1) != 1 or _number(body, "best_of", int, 1) != 1:
        raise RequestError("only n = 1 (and best_of = 1) is supported", param="n")
    logprobs = _logprobs(body, kind)
    if body.get("echo"):
        raise RequestError("echo is not supported", param="echo")
    if body.get("stop") not in (None, [], ""):
        raise RequestError("'stop' strings are not supported: use 'stop_token_ids'", param="stop")
    for penalty in ("presence_penalty", "frequency_penalty"):
        if _number(body, penalty, float, 0.0) != 0.0:
            raise RequestError(f"'{penalty}' is not supported (only 0)", param=penalty)
    prompts = _prompts(body, model) if kind == "completion" else [_chat_prompt(body, model)]
    longest = max(len(p) for p in prompts)
    if longest >= model.max_model_len:
        param = "prompt" if kind == "completion" else "messages"
        raise RequestError(f"the prompt has {longest} tokens; this model's context is {model.max_model_len} (room "
                           "for one new token is needed)", param=param)  # fmt: skip
    room = model.max_model_len - longest
    key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, int, 16 if kind == "completion" else room, lo=1)
    stop = body.get("stop_token_ids") or []
    if not isinstance(stop, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
        raise RequestError("'stop_token_ids' must be a list of token ids", param="stop_token_ids")
    if not body.get("ignore_eos"):
        stop = list(stop) + [t for t in model.eos_token_ids if t not in stop]
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"'seed' must be an integer, got {seed!r}", param="seed")
    params = SamplingParams(
        temperature=_number(body, "temperature", float, 1.0, lo=0.0, hi=2.0),
        top_p=_number(body, "top_p", float, 1.0, lo=0.0, hi=1.0, lo_open=True),
        max_tokens=max_tokens,
        stop_token_ids=tuple(stop),
        seed=seed,
        logprobs=logprobs,
    )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise RequestError("'stream_options' takes include_usage", param="stream_options")
    return ParsedRequest(kind, prompts, params, stream, bool(options.get("include_usage")))


def decode(model: ServedModel, ids: list[int]) -> str:
    """The text of generated ids ("" without a tokenizer: the ids are in each choice's token_ids)."""
    return model.tokenizer.decode(ids, skip_special_tokens=True) if model.tokenizer is not None else ""


def token_text(model: ServedModel, token_id: int) -> str:
    """One token's text in a logprobs object ("token_id:N" without a tokenizer)."""
    return model.tokenizer.decode([token_id]) if model.tokenizer is not None else f"token_id:{token_id}"


def _by_text(model: ServedModel, top: tuple[tuple[int, float], ...]) -> dict[str, float]:
    """The completions API's top_logprobs entry, a dict keyed by text: of tokens with the same text, the likelier."""
    out: dict[str, float] = {}
    for token_id, logprob in top:
        out.setdefault(token_text(model, token_id), logprob)
    return out


def logprobs_body(req: ParsedRequest, model: ServedModel, ids: list[int], logprobs: list[TokenLogprobs] | None,
                  offset: int = 0) -> dict[str, Any] | None:  # fmt: skip
    """A choice's `logprobs` for generated `ids` (None where the request asked for none): the completions API's
    tokens / token_logprobs / top_logprobs / text_offset (`offset`: the text of the tokens before these, streaming),
    or the chat API's content list, whose entries also carry each token's id (the completions API's top_logprobs
    are dicts keyed by text, where two tokens of one text are one entry)."""
    if logprobs is None or req.params.logprobs is None:
        return None
    texts = [token_text(model, t) for t in ids]
    if req.kind == "completion":
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": texts, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [_by_text(model, lp.top) for lp in logprobs],
                "text_offset": offsets}  # fmt: skip

    def entry(token_id: int, text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "token_id": token_id}

    return {"content": [{**entry(t, text, lp.logprob), "top_logprobs": [entry(i, token_text(model, i), v)
                                                                         for i, v in lp.top]}
                        for t, text, lp in zip(ids, texts, logprobs)]}  # fmt: skip


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The `usage` object of a response."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def response(req: ParsedRequest, model: ServedModel,
             outputs: list[tuple[list[int], str, list[TokenLogprobs] | None]]) -> dict[str, Any]:  # fmt: skip
    """The whole (non-streamed) response: outputs[i] = (generated ids, finish reason, their logprobs) of prompt i."""
    if req.kind == "completion":
        choices = [{"index": i, "text": decode(model, ids), "token_ids": ids,
                    "logprobs": logprobs_body(req, model, ids, lps), "finish_reason": reason}
                   for i, (ids, reason, lps) in enumerate(outputs)]  # fmt: skip
        head = {"id": f"cmpl-{req.request_id}", "object": "text_completion"}
    else:
        ids, reason, lps = outputs[0]
        choices = [{"index": 0, "message": {"role": "assistant", "content": decode(model, ids)}, "token_ids": ids,
                    "logprobs": logprobs_body(req, model, ids, lps), "finish_reason": reason}]  # fmt: skip
        head = {"id": f"chatcmpl-{req.request_id}", "object": "chat.completion"}
    used = usage(sum(map(len, req.prompts)), sum(len(ids) for ids, *_ in outputs))
    return {**head, "created": req.created, "model": model.name, "choices": choices, "usage": used}


def chunk(req: ParsedRequest, model: ServedModel, index: int, *, text: str = "", token_ids: list[int] | None = None,
          finish_reason: str | None = None, first: bool = False, logprobs: dict[str, Any] | None = None
          ) -> dict[str, Any]:  # fmt: skip
    """One streamed chunk of choice `index`: new text and token ids (and their logprobs_body), and the finish reason
    on the last."""
    ids = token_ids or []
    if req.kind == "completion":
        choice = {"index": index, "text": text, "token_ids": ids, "logprobs": logprobs, "finish_reason": finish_reason}
        head = {"id": f"cmpl-{req.request_id}", "object": "text_completion"}
    else:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text or ids else {})
        choice = {"index": index, "delta": delta, "token_ids": ids, "logprobs": logprobs,
                  "finish_reason": finish_reason}  # fmt: skip
        head = {"id": f"chatcmpl-{req.request_id}", "object": "chat.completion.chunk"}
    return {**head, "created": req.created, "model": model.name, "choices": [choice]}


def usage_chunk(req: ParsedRequest, model: ServedModel, completion_tokens: int) -> dict[str, Any]:
    """The last chunk with stream_options.include_usage: no choices, the request's usage."""
    head = chunk(req, model, 0)
    return {**head, "choices": [], "usage": usage(sum(map(len, req.prompts)), completion_tokens)}
