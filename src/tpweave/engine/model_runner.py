"""One per rank: owns the model, its paged KV cache, the step's input tensors, CUDA graphs of decode
steps, and sampling.

On CUDA the KV cache is sized from the memory left after an eager warm-up at the largest step
(max_num_batched_tokens), agreed as the minimum over ranks. Decode steps (one new token per
sequence) replay a CUDA graph captured per batch-size bucket; prefill and mixed steps run the
compiled model with dynamic M. The page pool has one block more than the block manager hands out:
padded rows of a graph bucket write their K/V there.
"""

from __future__ import annotations

import bisect

import torch
import torch.distributed as dist

from tpweave import compiler
from tpweave.compiler import PLAIN_TP, CompileOptions
from tpweave.engine.block_manager import slot_of
from tpweave.engine.config import EngineConfig
from tpweave.engine.scheduler import ScheduledChunk
from tpweave.log import progress
from tpweave.models import build_model
from tpweave.runtime.context import TPContext

DEFAULT_CPU_BLOCKS = 256


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a captured decode graph: 1, 2, 4, 8, then every 16 up to max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class ModelRunner:
    """The model of one rank, its paged KV cache, step inputs, decode CUDA graphs and sampling."""

    def __init__(self, ctx: TPContext, source, config: EngineConfig):
        if config.max_model_len is None:
            raise ValueError("ModelRunner needs config.max_model_len (LLMEngine fills it from the model)")
        self.ctx, self.config, self.block_size, self.dtype = ctx, config, config.block_size, config.dtype
        self.model = build_model(source, tp=ctx, dtype=config.dtype, seed=config.seed, **config.model_overrides)
        self.on_cuda = ctx.device.type == "cuda"
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks = DEFAULT_CPU_BLOCKS
            if self.on_cuda:
                num_blocks = self._blocks_from_free_memory(config.max_num_batched_tokens, config.gpu_memory_utilization)
        self.num_blocks = num_blocks
        self.pad_block = num_blocks  # never handed out
        self.model.set_kv_cache((num_blocks + 1) * config.block_size)
        self.forward = self.model
        if config.compile_model and ctx.world_size > 1:
            # baseline: the plain TP graph (the model's NCCL all-reduces) for A/B runs
            options = PLAIN_TP if config.baseline else CompileOptions()
            self.forward = compiler.compile(self.model, options=options, sp_min_tokens=config.sp_min_tokens)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._static_out: dict[int, torch.Tensor] = {}  # each decode graph's output (logits of its bucket)
        self.num_graph_replays = 0
        if config.cuda_graphs and self.on_cuda:
            # The largest step first: compiles its graph and sizes symmetric-memory buffers and
            # workspaces for the largest M, so nothing is reallocated under a captured graph.
            self._largest_step(config.max_num_batched_tokens)
            self._capture_decode_graphs(decode_buckets(config.max_num_seqs))

    def release(self) -> None:
        """Drop the decode CUDA graphs, their outputs and the KV cache (before another runner allocates its
        own in this process); the runner cannot step afterwards."""
        self.graphs.clear()
        self._static_out.clear()
        self.model.set_kv_cache(None)

    # -- memory -----------------------------------------------------------------------------------
    def _blocks_from_free_memory(self, num_tokens: int, utilization: float) -> int:
        """Blocks that fit in utilization x GPU memory after weights and the peak of a warm-up step."""
        progress("sizing the KV cache: a warm-up step of %d tokens", num_tokens)
        cfg, dev = self.model.config, self.ctx.device
        kv_heads = cfg.num_kv_heads // self.ctx.world_size
        # A throwaway cache for one sequence of num_tokens: the warm-up runs the engine's code path.
        scratch = (-(-num_tokens // self.block_size)) * self.block_size
        self.model.set_kv_cache(scratch)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        with torch.no_grad():
            ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
            pos = torch.arange(num_tokens, device=dev)
            cu = torch.tensor([0, num_tokens], dtype=torch.int32, device=dev)
            table = torch.arange(scratch // self.block_size, dtype=torch.int32, device=dev)[None]
            self.model(ids, pos, cu, pos, cu[1:], table, self.block_size, cu[1:] - 1)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        self.model.set_kv_cache(None)
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(dev).total_memory
        block_bytes = 2 * cfg.num_layers * self.block_size * kv_heads * cfg.head_dim * self.dtype.itemsize
        num_blocks = int((total * utilization - peak) // block_bytes) - 1  # - the pad block
        if self.ctx.world_size > 1:
            t = torch.tensor([num_blocks], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctx.group)
            num_blocks = int(t)
        if num_blocks < self.max_blocks_per_seq:
            raise ValueError(
                f"KV cache: {num_blocks} blocks of {self.block_size} tokens fit in {utilization:.0%} of GPU memory "
                "after "
                f"weights and a {num_tokens}-token step (peak {peak / 2**30:.1f} GiB), fewer than one sequence of the "
                "context length needs: lower max_model_len or max_num_batched_tokens, or raise gpu_memory_utilization"
            )
        return num_blocks

    # -- step inputs ------------------------------------------------------------------------------
    def _inputs(self, chunks: list[ScheduledChunk]) -> tuple:
        ids, positions, slots, cu, ctx_lens, rows = [], [], [], [0], [], []
        max_blocks = max(len(c.seq.block_table) for c in chunks)
        tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
        for b, c in enumerate(chunks):
            ids += c.seq.token_ids[c.start : c.start + c.num_tokens]
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

    # -- CUDA graphs of decode steps ----------------------------------------------------------------
    def _decode_host_inputs(self, chunks: list[ScheduledChunk], bucket: int) -> list[torch.Tensor]:
        """Static-shape inputs of a decode step padded to `bucket` rows; pad rows use the pad block."""
        n, pad_slot = len(chunks), self.pad_block * self.block_size
        ids = torch.zeros(bucket, dtype=torch.long)
        pos = torch.zeros(bucket, dtype=torch.long)
        slots = torch.full((bucket,), pad_slot, dtype=torch.long)
        ctx_lens = torch.ones(bucket, dtype=torch.int32)
        tables = torch.full((bucket, self.max_blocks_per_seq), self.pad_block, dtype=torch.int32)
        for b, c in enumerate(chunks):
            ids[b] = c.seq.token_ids[c.start]
            pos[b] = c.start
            slots[b] = slot_of(c.seq.block_table, c.start, self.block_size)
            ctx_lens[b] = c.start + 1
            tables[b, : len(c.seq.block_table)] = torch.tensor(c.seq.block_table, dtype=torch.int32)
        assert n <= bucket, (n, bucket)  # the caller picked a bucket that holds the batch
        return [ids, pos, slots, ctx_lens, tables]

    @torch.no_grad()
    def _largest_step(self, num_tokens: int) -> None:
        """One prefill step of num_tokens tokens whose K/V all go to the pad block (never read)."""
        dev, bs = self.ctx.device, self.block_size
        pos = torch.arange(num_tokens, device=dev)
        cu = torch.tensor([0, num_tokens], dtype=torch.int32, device=dev)
        slots = self.pad_block * bs + pos % bs
        tables = torch.full((1, -(-num_tokens // bs)), self.pad_block, dtype=torch.int32, device=dev)
        positions = pos % self.model.config.max_position_embeddings
        self.forward(
            torch.zeros(num_tokens, dtype=torch.long, device=dev), positions, cu, slots, cu[1:], tables, bs, cu[1:] - 1
        )
        torch.cuda.synchronize(dev)

    def _capture_decode_graphs(self, buckets: list[int]) -> None:
        progress("capturing decode CUDA graphs for %d batch sizes (up to %d)", len(buckets), max(buckets))
        dev, top = self.ctx.device, max(buckets)
        self._static = [t.to(dev) for t in self._decode_host_inputs([], top)]
        self._static_cu = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self._static_rows = torch.arange(top, device=dev)  # int64, like the eager path's rows
        pool = None
        with torch.no_grad():
            for bucket in sorted(buckets, reverse=True):  # largest first: workspaces sized once
                args = self._bucket_args(bucket)
                self.forward(*args)  # warm-up (compiles on the first bucket)
                torch.cuda.synchronize(dev)
                if self.ctx.world_size > 1:
                    dist.barrier(group=self.ctx.group)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._static_out[bucket] = self.forward(*args)
                pool = graph.pool()
                self.graphs[bucket] = graph
        self._buckets = sorted(buckets)

    def _bucket_args(self, bucket: int) -> tuple:
        ids, pos, slots, ctx_lens, tables = (t[:bucket] for t in self._static)
        return (
            ids,
            pos,
            self._static_cu[: bucket + 1],
            slots,
            ctx_lens,
            tables,
            self.block_size,
            self._static_rows[:bucket],
        )

    def _decode_with_graph(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        if not self.graphs or any(c.num_tokens != 1 for c in chunks) or len(chunks) > self._buckets[-1]:
            return None
        if max(len(c.seq.block_table) for c in chunks) > self.max_blocks_per_seq:
            return None
        bucket = self._buckets[bisect.bisect_left(self._buckets, len(chunks))]
        for dst, src in zip(self._static, self._decode_host_inputs(chunks, bucket)):
            dst[:bucket].copy_(src, non_blocking=True)
        self.graphs[bucket].replay()
        self.num_graph_replays += 1
        return self._static_out[bucket][: len(chunks)]

    # -- the step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, chunks: list[ScheduledChunk], step: int) -> dict[int, int]:
        """Compute the step; return the next token of every sequence whose chunk reached its end."""
        if not chunks:
            return {}
        logits = self._decode_with_graph(chunks)
        if logits is None:
            logits = self.forward(*self._inputs(chunks))  # (B, V): the last row of each chunk
        logits = logits.float()
        greedy = logits.argmax(-1).tolist()  # one host sync for every greedy row
        out = {}
        for b, c in enumerate(chunks):
            if not c.samples:
                continue
            params = c.seq.params
            if params.temperature == 0:
                out[c.seq.seq_id] = greedy[b]
            else:
                out[c.seq.seq_id] = sample(
                    logits[b], params, seed=(params.seed or 0) * 1_000_003 + step * 7919 + c.seq.seq_id
                )
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
