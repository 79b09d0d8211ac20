"""Reference TP models: build from a preset (random weights) or from an HF-format directory."""

from __future__ import annotations

from pathlib import Path

import torch

from tpweave.models.config import PRESETS, ModelConfig, get_preset
from tpweave.models.llama import LlamaForCausalLM
from tpweave.models.weights import SafetensorsFetch, load_weights, random_fetch, random_hf_state, save_hf_checkpoint
from tpweave.runtime.agreement import check_ranks_agree
from tpweave.runtime.context import TPContext


def resolve_config(source: str | ModelConfig, **overrides) -> ModelConfig:
    """The ModelConfig of a ModelConfig, an HF-format directory (its config.json) or a preset name, with
    `overrides` (ModelConfig fields) applied."""
    if isinstance(source, ModelConfig):
        return source.replace(**overrides) if overrides else source
    if Path(source).is_dir():
        cfg = ModelConfig.from_dir(source)
        return cfg.replace(**overrides) if overrides else cfg
    return get_preset(source, **overrides)


def build_model(
    source: str | ModelConfig,
    *,
    tp: TPContext,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    **overrides,
) -> LlamaForCausalLM:
    """A preset name or ModelConfig gives random weights from `seed`; a directory loads its safetensors."""
    cfg = resolve_config(source, **overrides)
    cfg.check_tp(tp.world_size)
    from_dir = not isinstance(source, ModelConfig) and Path(source).is_dir()
    check_ranks_agree(
        {"config": cfg.__dict__, "dtype": str(dtype), "seed": seed, "source": str(source), "tp": tp.world_size},
        group=tp.group,
        what="the model",
    )
    model = LlamaForCausalLM(cfg, tp=tp, dtype=dtype)
    fetch = (
        SafetensorsFetch(source, cfg, dtype=dtype, device=tp.device)
        if from_dir
        else random_fetch(cfg, seed=seed, dtype=dtype, device=tp.device)
    )
    load_weights(model, cfg, fetch, rank=tp.rank, tp=tp.world_size)
    return model.eval()


__all__ = [
    "PRESETS",
    "LlamaForCausalLM",
    "ModelConfig",
    "build_model",
    "get_preset",
    "random_hf_state",
    "resolve_config",
    "save_hf_checkpoint",
]
