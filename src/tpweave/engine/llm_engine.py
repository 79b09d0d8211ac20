"""LLMEngine: add_request / step / generate. Under TP every rank runs the same engine loop (SPMD):
the scheduler is deterministic and the gathered logits and seeded sampling are the same on every
rank, so all ranks take the same steps.

Asynchronous scheduling (EngineConfig.async_scheduling, on by default): step() plans and launches step
N+1 before it reads step N's sampled tokens, so the host's work (scheduling, inputs, stop conditions)
runs while the device computes, and the one host sync of a step waits behind work already queued.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tpweave.engine.block_manager import BlockManager
from tpweave.engine.config import EngineConfig
from tpweave.engine.model_runner import LaunchedStep, ModelRunner
from tpweave.engine.scheduler import Scheduler, SchedulerOutput
from tpweave.engine.sequence import SamplingParams, Sequence
from tpweave.runtime.context import TPContext


class LLMEngine:
    """The reference engine: add_request / step / generate over a ModelRunner and a Scheduler."""

    def __init__(self, ctx: TPContext, source, config: EngineConfig | None = None, **overrides: Any):
        """`config` (default EngineConfig()) with `overrides` applied (EngineConfig fields, or ModelConfig
        fields such as num_layers: EngineConfig.from_kwargs)."""
        from tpweave.models import resolve_config

        config = EngineConfig.from_kwargs(config, **overrides)
        if config.max_model_len is None:
            max_len = resolve_config(source, **config.model_overrides).max_position_embeddings
            config = dataclasses.replace(config, max_model_len=max_len)
        self.config = config
        self.runner = ModelRunner(ctx, source, config)
        self.vocab_size = self.runner.model.config.vocab_size
        self.scheduler = Scheduler(
            block_manager=BlockManager(num_blocks=self.runner.num_blocks, block_size=config.block_size),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
        )
        self.num_steps = 0
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None  # launched, tokens not read yet

    def release(self) -> None:
        """Free the KV cache and the CUDA graphs (the engine cannot step afterwards)."""
        self.runner.release()

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> Sequence:
        """Queue a prompt (token ids) with `params` (default SamplingParams()); the new Sequence. ValueError,
        and nothing queued, for a token id outside the vocabulary or a request the scheduler rejects."""
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:4]} are outside the vocabulary [0, {self.vocab_size})")
        seq = Sequence(list(prompt_token_ids), params or SamplingParams())
        self.scheduler.add(seq)
        return seq

    def warm_up(self) -> None:
        """Compile every graph serving will meet (the SP and plain variants, the CUDA graphs) before the first
        request: a step of the largest token count the scheduler can form, and a short prompt."""
        longest = min(self.scheduler.max_num_batched_tokens, self.scheduler.max_model_len - 4)
        results = self.generate([[1] * longest, [1] * 7], SamplingParams(max_tokens=3))
        errors = [r["error"] for r in results if r["error"]]
        if errors:
            raise RuntimeError(f"warm-up requests failed: {errors}")

    def abort(self, seq: Sequence) -> None:
        """End a queued or running request now: its KV blocks are free again, its finish_reason is "abort"."""
        self.scheduler.abort(seq)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running, or has tokens in flight."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[Sequence]:
        """Schedule and launch one step, then read back the tokens of the step before it (asynchronous
        scheduling) or of this one; the sequences that finished or failed meanwhile."""
        out = self.scheduler.schedule()
        launched = self.runner.launch(out.chunks)
        self.num_steps += bool(out.chunks)
        done = list(out.failed)
        if self._in_flight is not None:
            out_before, step_before = self._in_flight
            done = self.scheduler.postprocess(out_before, step_before.read(), step_before.read_logprobs()) + done
            self._in_flight = None
        if out.chunks:
            if self.config.async_scheduling:
                self._in_flight = (out, launched)
            else:
                done = self.scheduler.postprocess(out, launched.read(), launched.read_logprobs()) + done
        return done

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[dict[str, Any]]:
        """Every prompt gets a result: its tokens and finish reason, or the error that rejected it; with
        SamplingParams.logprobs, "logprobs": a TokenLogprobs per generated token (else None)."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        results: list[dict[str, Any]] = []
        seqs: list[Sequence | None] = []
        for prompt, p in zip(prompts, params_list):
            try:
                seqs.append(self.add_request(prompt, p))
                results.append({})
            except ValueError as e:
                seqs.append(None)
                results.append({"token_ids": [], "finish_reason": None, "error": str(e), "logprobs": None})
        while self.has_unfinished():
            self.step()
        for i, seq in enumerate(seqs):
            if seq is not None:
                results[i] = {
                    "token_ids": list(seq.output_token_ids),
                    "finish_reason": seq.finish_reason,
                    "error": seq.error,
                    "num_preemptions": seq.num_preemptions,
                    "logprobs": list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                }
        return results
