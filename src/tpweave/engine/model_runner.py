"""One per rank: owns the model, its paged KV cache, the step's input tensors, and sampling."""
from __future__ import annotations

import torch

from tpweave.engine.block_manager import slot_of
from tpweave.engine.scheduler import ScheduledChunk
from tpweave.models import build_model
from tpweave.runtime.context import TPContext


class ModelRunner:
    def __init__(self, ctx: TPContext, source, *, dtype: torch.dtype, seed: int, num_blocks: int, block_size: int,
                 compile_model: bool, sp_min_tokens: int | None = None, **overrides):
        self.ctx, self.block_size = ctx, block_size
        self.model = build_model(source, tp=ctx, dtype=dtype, seed=seed, **overrides)
        cfg = self.model.config
        shape = (num_blocks * block_size, cfg.num_kv_heads // ctx.world_size, cfg.head_dim)
        for layer in self.model.model.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=dtype, device=ctx.device)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=dtype, device=ctx.device)
        self.forward = self.model
        if compile_model and ctx.world_size > 1:
            import tpweave

            self.forward = tpweave.compile(self.model, sp_min_tokens=sp_min_tokens)

    def _inputs(self, chunks: list[ScheduledChunk]) -> tuple:
        ids, positions, slots, cu, ctx_lens, rows = [], [], [], [0], [], []
        max_blocks = max(len(c.seq.block_table) for c in chunks)
        tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
        for b, c in enumerate(chunks):
            tokens = c.seq.token_ids[c.start : c.start + c.num_tokens]
            ids += tokens
            positions += range(c.start, c.start + c.num_tokens)
            table = c.seq.block_table
            slots += [slot_of(table, p, self.block_size) for p in range(c.start, c.start + c.num_tokens)]
            cu.append(cu[-1] + c.num_tokens)
            ctx_lens.append(c.start + c.num_tokens)
            tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
            rows.append(cu[-1] - 1)
        dev = self.ctx.device
        return (
            torch.tensor(ids, device=dev),
            torch.tensor(positions, device=dev),
            torch.tensor(cu, dtype=torch.int32, device=dev),
            torch.tensor(slots, device=dev),
            torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
            tables.to(dev),
            self.block_size,
            torch.tensor(rows, device=dev),
        )

    @torch.no_grad()
    def run(self, chunks: list[ScheduledChunk], step: int) -> dict[int, int]:
        """Compute the step; return the next token of every sequence whose chunk reached its end."""
        if not chunks:
            return {}
        logits = self.forward(*self._inputs(chunks)).float()  # (B, V): the last row of each chunk
        out = {}
        for b, c in enumerate(chunks):
            if c.samples:
                out[c.seq.seq_id] = sample(logits[b], c.seq.params, seed=(c.seq.params.seed or 0) * 1_000_003 + step * 7919 + c.seq.seq_id)
        return out


def sample(logits_V: torch.Tensor, params, *, seed: int) -> int:
    """Greedy at temperature 0; else temperature + top-p with a seeded generator (every rank draws alike)."""
    if params.temperature == 0:
        return int(logits_V.argmax())
    probs = torch.softmax(logits_V / params.temperature, dim=-1)
    sorted_p, order = probs.sort(descending=True)
    keep = sorted_p.cumsum(0) - sorted_p < params.top_p  # smallest prefix with mass >= top_p
    sorted_p = torch.where(keep, sorted_p, 0.0)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    choice = torch.multinomial((sorted_p / sorted_p.sum()).cpu(), 1, generator=gen)
    return int(order[choice.to(order.device)])
