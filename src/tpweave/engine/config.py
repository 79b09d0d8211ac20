"""The engine's options, one frozen object: what LLMEngine and ModelRunner take."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tpweave.engine.buckets import check_sizes
from tpweave.models.config import ModelConfig


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """KV cache, batching and compilation settings of the reference engine.

    num_blocks=None: sized from free GPU memory on CUDA (256 on CPU). max_model_len=None: the model's
    max_position_embeddings. baseline=True: plain TP (the model's NCCL all-reduces, no SP or async TP),
    for A/B runs. cuda_graphs: decode steps replay a graph captured per batch-size bucket (CUDA only), and with
    piecewise_graphs prefill and mixed steps replay the pieces between attention ops, captured per token-count
    bucket (`prefill_graph_sizes`, default engine/buckets.py's up to max_num_batched_tokens; steps padded up);
    with whole_step_graphs, such steps replay instead one graph of the whole forward per bucket, attention included
    (their sequences padded to a fixed count).
    async_scheduling: plan and launch each step before reading the previous step's tokens (engine/llm_engine.py).
    model_overrides: ModelConfig fields to change (e.g. num_layers)."""

    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    compile_model: bool = True
    baseline: bool = False
    sp_min_tokens: int | None = None
    token_split_min_tokens: int | None = None  # None: the calibration table's (CompileOptions)
    cuda_graphs: bool = True
    piecewise_graphs: bool = True
    whole_step_graphs: bool = True
    prefill_graph_sizes: tuple[int, ...] | None = None
    async_scheduling: bool = True
    gpu_memory_utilization: float = 0.9
    invariant: str | None = None  # CompileOptions.invariant: "batch" (whatever shares its steps), "tp" (and any TP)
    model_overrides: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if self.prefill_graph_sizes is not None:
            sizes = check_sizes(self.prefill_graph_sizes, self.max_num_batched_tokens, "prefill_graph_sizes")
            object.__setattr__(self, "prefill_graph_sizes", tuple(sizes))
        if self.invariant not in (None, "batch", "tp"):
            raise ValueError(f"invariant must be None, 'batch' or 'tp', got {self.invariant!r}")
        if self.invariant is not None and not self.compile_model:
            raise ValueError("invariant='batch' needs compile_model=True: the compiler swaps the invariant kernels in")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
        unknown = sorted(set(self.model_overrides) - model_fields)
        if unknown:
            raise TypeError(
                f"unknown model override(s) {', '.join(unknown)}: ModelConfig fields are {sorted(model_fields)}"
            )

    @classmethod
    def from_kwargs(cls, config: EngineConfig | None = None, **kwargs: Any) -> EngineConfig:
        """`config` (default EngineConfig()) with kwargs applied: EngineConfig fields set themselves,
        ModelConfig fields (num_layers, ...) join model_overrides; anything else is a TypeError."""
        config = config or cls()
        own = {f.name for f in dataclasses.fields(cls)}
        changes = {k: v for k, v in kwargs.items() if k in own}
        model = {k: v for k, v in kwargs.items() if k not in own}
        if model:
            changes["model_overrides"] = {**config.model_overrides, **changes.get("model_overrides", {}), **model}
        return dataclasses.replace(config, **changes) if changes else config
