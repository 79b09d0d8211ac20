"""LLMEngine: add_request / step / generate. Under TP every rank runs the same engine loop (SPMD):
the scheduler is deterministic and the gathered logits and seeded sampling are the same on every
rank, so all ranks take the same steps."""

from __future__ import annotations

from typing import Any

import torch

from tpweave.engine.block_manager import BlockManager
from tpweave.engine.model_runner import ModelRunner
from tpweave.engine.scheduler import Scheduler
from tpweave.engine.sequence import SamplingParams, Sequence
from tpweave.runtime.context import TPContext


class LLMEngine:
    def __init__(
        self,
        ctx: TPContext,
        source,
        *,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        compile_model: bool = True,
        baseline: bool = False,
        sp_min_tokens: int | None = None,
        cuda_graphs: bool = True,
        gpu_memory_utilization: float = 0.9,
        **overrides,
    ):
        """num_blocks=None: sized from free GPU memory on CUDA (256 on CPU). baseline=True: plain TP
        (the model's NCCL all-reduces, no SP or async TP), for A/B runs. cuda_graphs: decode steps
        replay a graph captured per batch-size bucket (CUDA only)."""
        from tpweave.models import resolve_config

        max_model_len = max_model_len or resolve_config(source, **overrides).max_position_embeddings
        self.runner = ModelRunner(
            ctx,
            source,
            dtype=dtype,
            seed=seed,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            compile_model=compile_model,
            baseline=baseline,
            sp_min_tokens=sp_min_tokens,
            cuda_graphs=cuda_graphs,
            gpu_memory_utilization=gpu_memory_utilization,
            **overrides,
        )
        cfg = self.runner.model.config
        self.vocab_size = cfg.vocab_size
        self.scheduler = Scheduler(
            block_manager=BlockManager(num_blocks=self.runner.num_blocks, block_size=block_size),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        self.num_steps = 0

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> Sequence:
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:4]} are outside the vocabulary [0, {self.vocab_size})")
        seq = Sequence(list(prompt_token_ids), params or SamplingParams())
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[Sequence]:
        out = self.scheduler.schedule()
        next_tokens = self.runner.run(out.chunks, self.num_steps)
        self.num_steps += 1
        return self.scheduler.postprocess(out, next_tokens) + out.failed

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[dict[str, Any]]:
        """Every prompt gets a result: its tokens and finish reason, or the error that rejected it."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        results: list[dict[str, Any]] = []
        seqs: list[Sequence | None] = []
        for prompt, p in zip(prompts, params_list):
            try:
                seqs.append(self.add_request(prompt, p))
                results.append({})
            except ValueError as e:
                seqs.append(None)
                results.append({"token_ids": [], "finish_reason": None, "error": str(e)})
        while self.scheduler.has_unfinished():
            self.step()
        for i, seq in enumerate(seqs):
            if seq is not None:
                results[i] = {
                    "token_ids": list(seq.output_token_ids),
                    "finish_reason": seq.finish_reason,
                    "error": seq.error,
                    "num_preemptions": seq.num_preemptions,
                }
        return results
