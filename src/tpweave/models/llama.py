"""Llama-family decoder for inference (Llama 2/3, Qwen2 with QKV bias), tensor-parallel through its layers.

forward(input_ids_M, positions_M, cu_seqlens_B1) -> logits (M, V). The batch is packed: M tokens of
B sequences, sequence b spanning rows cu_seqlens[b]:cu_seqlens[b+1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpweave.models.config import ModelConfig
from tpweave.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    Quant,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tpweave.ops import attention as _attention_op  # noqa: F401  (registers tpweave::attention)
from tpweave.ops import select_rows as _select_rows_op  # noqa: F401  (registers tpweave::select_rows)
from tpweave.runtime.context import TPContext


@dataclass(frozen=True)
class KVMeta:
    """Paged-cache metadata of one step: slot of each new token, context length and blocks per sequence."""

    slot_mapping: Tensor  # (M,) int64
    context_lens: Tensor  # (B,) int32, cached + new tokens
    block_tables: Tensor  # (B, max_blocks) int32
    block_size: int
    fresh: Tensor | None = None  # 0-dim bool on the CPU: no sequence has cached context (ops/attention.py)


class Attention(nn.Module):
    """Self-attention with this rank's q and kv heads: fused QKV projection (column-parallel), RoPE,
    attention over the packed batch or the paged KV cache, output projection (row-parallel)."""

    def __init__(self, cfg: ModelConfig, *, tp: TPContext, dtype: torch.dtype, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = cfg.num_heads // tp.world_size
        self.num_kv_heads = cfg.num_kv_heads // tp.world_size
        self.head_dim = cfg.head_dim
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        quant = Quant(cfg.quantization, cfg.activation_scheme)
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, qkv_out, tp=tp, bias=cfg.qkv_bias, dtype=dtype, quant=quant
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, tp=tp, dtype=dtype, quant=quant)
        self.rotary = rotary  # the model's one table, shared by every layer
        self.scale = cfg.head_dim**-0.5
        # Paged KV cache (num_slots, kv heads, head dim), attached by the engine's model runner.
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def forward(self, x_MH: Tensor, positions_M: Tensor, cu_seqlens: Tensor, kv: KVMeta | None = None) -> Tensor:
        """x (M, H) -> (M, H), summed over ranks. With `kv`, the new tokens' K/V are written to the cache at
        kv.slot_mapping and attention reads each sequence's whole context from it."""
        num_tokens = x_MH.shape[0]
        # View the contiguous qkv output as heads first, then split: views of the non-contiguous
        # q/k/v slices would make Inductor guard on M == 1 (a recompile at decode of one sequence).
        qkv_MXD = self.qkv_proj(x_MH).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv_MXD.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if kv is None:
            q, k = self.rotary(positions_M, q, k)
            o = torch.ops.tpweave.attention(q, k, v, cu_seqlens, self.scale)
        else:  # RoPE inside the paged op: one kernel for q and k
            o = torch.ops.tpweave.paged_attention(
                q,
                k,
                v,
                self.k_cache,
                self.v_cache,
                kv.slot_mapping,
                cu_seqlens,
                kv.context_lens,
                kv.block_tables,
                kv.block_size,
                self.scale,
                self.rotary.cos_sin,
                positions_M,
                kv.fresh,
            )
        return self.o_proj(o.view(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU MLP: gate and up projections fused (column-parallel), down projection (row-parallel)."""

    def __init__(self, cfg: ModelConfig, *, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        quant = Quant(cfg.quantization, cfg.activation_scheme)
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, 2 * cfg.intermediate_size, tp=tp, bias=False, dtype=dtype, quant=quant
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp=tp, dtype=dtype, quant=quant)

    def forward(self, x_MH: Tensor) -> Tensor:
        """x (M, H) -> down(silu(gate(x)) * up(x)) (M, H), summed over ranks."""
        gate, up = self.gate_up_proj(x_MH).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: x + attention(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: ModelConfig, *, tp: TPContext, dtype: torch.dtype, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, device=tp.device)
        self.self_attn = Attention(cfg, tp=tp, dtype=dtype, rotary=rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, device=tp.device)
        self.mlp = MLP(cfg, tp=tp, dtype=dtype)

    def forward(self, x_MH: Tensor, positions_M: Tensor, cu_seqlens: Tensor, kv: KVMeta | None = None) -> Tensor:
        """x (M, H) -> (M, H); `kv` as in Attention.forward."""
        h = x_MH + self.self_attn(self.input_layernorm(x_MH), positions_M, cu_seqlens, kv)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, the decoder layers and the final norm."""

    def __init__(self, cfg: ModelConfig, *, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype)
        # one cos/sin table for all layers (llama3-8b's 131072 positions: 67 MB of fp32, per layer if each had its own)
        rotary = RotaryEmbedding(
            cfg.head_dim,
            theta=cfg.rope_theta,
            scaling=cfg.rope_scaling,
            max_positions=cfg.max_position_embeddings,
            device=tp.device,
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp=tp, dtype=dtype, rotary=rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, device=tp.device)

    def forward(self, input_ids_M: Tensor, positions_M: Tensor, cu_seqlens: Tensor, kv: KVMeta | None = None) -> Tensor:
        """ids (M,) -> final hidden states (M, H); `kv` as in Attention.forward."""
        x_MH = self.embed_tokens(input_ids_M)
        for layer in self.layers:
            x_MH = layer(x_MH, positions_M, cu_seqlens, kv)
        return self.norm(x_MH)


class LlamaForCausalLM(nn.Module):
    """The decoder and its LM head, holding this rank's shards of every weight; forward(input_ids (M,),
    positions (M,), cu_seqlens (B + 1,)) -> logits (M, V)."""

    def __init__(self, cfg: ModelConfig, *, tp: TPContext, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        cfg.check_tp(tp.world_size)
        self.config = cfg
        self.tp = tp
        self.model = LlamaModel(cfg, tp=tp, dtype=dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_kv_cache(self, num_slots: int | None, *, share_with: LlamaForCausalLM | None = None) -> None:
        """Give every attention layer a paged KV cache of num_slots slots (None: drop it), in the
        model's dtype on its device, or the very tensors of `share_with`."""
        dtype = self.model.embed_tokens.weight.dtype
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            if share_with is not None:
                other = share_with.model.layers[i].self_attn
                attn.k_cache, attn.v_cache = other.k_cache, other.v_cache
            elif num_slots is None:
                attn.k_cache = attn.v_cache = None
            else:
                shape = (num_slots, attn.num_kv_heads, attn.head_dim)
                attn.k_cache = torch.zeros(shape, dtype=dtype, device=self.tp.device)
                attn.v_cache = torch.zeros(shape, dtype=dtype, device=self.tp.device)

    def forward(
        self,
        input_ids_M: Tensor,
        positions_M: Tensor,
        cu_seqlens: Tensor,
        slot_mapping: Tensor | None = None,
        context_lens: Tensor | None = None,
        block_tables: Tensor | None = None,
        block_size: int = 0,
        logits_rows: Tensor | None = None,
        fresh: Tensor | None = None,
    ) -> Tensor:
        """Without KV metadata: causal attention within the packed batch. With it (the engine): the
        new tokens attend to their whole context in the paged cache (`fresh`: see KVMeta). `logits_rows`
        picks the rows whose logits are wanted (default: every token)."""
        kv = None if slot_mapping is None else KVMeta(slot_mapping, context_lens, block_tables, block_size, fresh)
        hidden = self.model(input_ids_M, positions_M, cu_seqlens, kv)
        if logits_rows is not None:  # one op: where piecewise CUDA graphs cut (compiler/piecewise.py)
            hidden = torch.ops.tpweave.select_rows(hidden, logits_rows)
        return self.lm_head(hidden)
