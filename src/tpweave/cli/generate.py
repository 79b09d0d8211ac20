"""`tpweave generate`: the reference engine on text prompts, token ids or random prompts."""

from __future__ import annotations

import argparse
import random

from tpweave.cli.common import check_invariant, model_config, rank_options
from tpweave.cli.errors import EXIT_FAILED, EXIT_OK, CLIError
from tpweave.cli.ranks import run_ranks
from tpweave.engine.sequence import MAX_LOGPROBS
from tpweave.log import progress
from tpweave.models.config import DTYPES
from tpweave.models.tokenizer import load_tokenizer


def generate_worker(ctx, model, prompts, sampling, engine_kwargs) -> list[dict]:
    """Every prompt's result: its tokens and finish reason, or the error that rejected it."""
    from tpweave.engine import LLMEngine, SamplingParams

    progress("building the engine (model, KV cache%s)", ", compile" if engine_kwargs.get("compile_model") else "")
    engine = LLMEngine(ctx, model, **engine_kwargs)
    progress("generating %d prompt(s)", len(prompts))
    results = engine.generate(prompts, SamplingParams(**sampling))
    progress("done: %d step(s)", engine.num_steps)
    return results


def _prompts(args: argparse.Namespace, vocab_size: int, tok) -> list[list[int]]:
    if args.prompt:
        if tok is None:
            raise CLIError(
                "--prompt needs a model directory with a tokenizer (and transformers installed); use --prompt-ids"
            )
        return [tok.encode(p) for p in args.prompt]
    if args.prompt_ids:
        prompts = []
        for text in args.prompt_ids:
            try:
                ids = [int(t) for t in text.split(",") if t.strip()]
            except ValueError:
                raise CLIError(f"--prompt-ids {text!r}: expected comma-separated integers") from None
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise CLIError(
                    f"--prompt-ids {text!r}: token id(s) {bad[:4]} outside the model's vocabulary [0, {vocab_size})"
                )
            prompts.append(ids)
        return prompts
    rng = random.Random(args.seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(4, 64))] for _ in range(args.num_prompts)]


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate and print each completion (decoded when the model directory has a tokenizer); exit status
    1 when every prompt was rejected, with a summary line of the rejected ones."""
    cfg = model_config(args)
    if args.temperature < 0:
        raise CLIError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise CLIError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:
        raise CLIError(f"--logprobs must be in [0, {MAX_LOGPROBS}], got {args.logprobs}")
    check_invariant(args)
    tok = load_tokenizer(args.model)
    prompts = _prompts(args, cfg.vocab_size, tok)
    engine_kwargs = {
        "dtype": DTYPES[args.dtype],
        "block_size": args.block_size,
        "num_blocks": args.num_gpu_blocks_override,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "compile_model": not args.no_compile,
        "max_num_seqs": args.max_num_seqs,
        "baseline": args.baseline,
        "cuda_graphs": not args.enforce_eager,
        "invariant": args.invariant,
    }
    if args.num_layers:
        engine_kwargs["num_layers"] = args.num_layers
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "max_tokens": args.max_tokens, "seed": args.seed,
                "logprobs": args.logprobs}  # fmt: skip
    results = run_ranks(generate_worker, args.model, prompts, sampling, engine_kwargs, opts=rank_options(args))[0]
    for i, (prompt, r) in enumerate(zip(prompts, results)):
        if r["error"]:
            print(f"[{i}] rejected: {r['error']}")
        elif tok is not None:
            print(f"[{i}] {tok.decode(prompt)!r} -> {tok.decode(r['token_ids'])!r} ({r['finish_reason']})")
        else:
            print(f"[{i}] {len(prompt)} prompt tokens -> {r['token_ids']} ({r['finish_reason']})")
        for t, lp in zip(r["token_ids"], r["logprobs"] or []):  # every digit: runs compare bit for bit
            top = ", ".join(f"{j}: {v!r}" for j, v in lp.top)
            print(f"    {t}: {lp.logprob!r}" + (f"  (top: {top})" if top else ""))
    rejected = sum(1 for r in results if r["error"])
    if rejected:
        print(f"{rejected} of {len(results)} prompt(s) rejected")
    return EXIT_FAILED if rejected == len(results) else EXIT_OK
