"""One per rank: owns the model, its paged KV cache, the step's input tensors, its CUDA graphs, and
sampling.

A step is launched, not waited for: launch() builds the inputs on the host (numpy), copies them to the
device without blocking, runs the forward and the sampling, and starts copying the sampled tokens to
pinned host memory behind an event. Tokens still pending on the host (Sequence.PENDING, sampled by the
step before) are taken from that step's device tensor, so the next step can be launched before the
host has read the previous one's tokens. A step replayed from a CUDA graph sends its inputs in one copy
from pinned memory (engine/staging.py), and its graph takes the pending tokens itself, from a buffer the
previous step's sampling wrote: between two decode graphs the stream runs that copy, the sampling and the
copy of the sampled tokens to the host, nothing else.

On CUDA the KV cache is sized from the memory left after an eager warm-up at the largest step
(max_num_batched_tokens), agreed as the minimum over ranks. Decode steps (one new token per
sequence) replay a CUDA graph of the whole forward captured per batch-size bucket. Prefill and mixed
steps are padded up to a token-count bucket (engine/buckets.py); the padding rows are one more
sequence, of their own, in the pad block. Such a step replays a CUDA graph of the whole forward, attention
included, captured per bucket and per kind (every sequence fresh, or some with cached context): the
attention kernels' launches depend on shapes alone, so the step's sequences are padded too, to a fixed
count of sequences (the rest have no tokens: their attention programs, invariant mode's too, find no
rows and return) and a fixed block-table width. Without those graphs (`whole_step_graphs=False`) the step replays the
compiled forward's pieces between its attention ops, captured per bucket (compiler/piecewise.py),
attention running eagerly between them.
The sequence-parallel, async-TP and token-split rewrites run inside every graph. Every graph shares one
memory pool. The page pool has one block more than the block manager hands out: padded rows of a graph
bucket write their K/V there.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from tpweave import compiler
from tpweave.compiler import PLAIN_TP, CompileOptions
from tpweave.compiler.piecewise import PiecewiseGraphs, weak_alias
from tpweave.engine.block_tables import BlockTableRows
from tpweave.engine.buckets import bucket_for, decode_buckets, prefill_buckets
from tpweave.engine.config import EngineConfig
from tpweave.engine.sampling import request_seed, sample
from tpweave.engine.scheduler import ScheduledChunk
from tpweave.engine.sequence import PENDING, TokenLogprobs
from tpweave.engine.staging import StagedInputs
from tpweave.log import progress
from tpweave.models import build_model
from tpweave.runtime.context import TPContext

# sequence counts a whole-step graph is captured for (then max_num_seqs + 1): x2 apart, so that a step's empty
# sequences (and padded logits rows) are fewer than its own
STEP_SEQ_BUCKETS = (9, 17, 33, 65, 129, 257, 513, 1025, 2049)
DEFAULT_CPU_BLOCKS = 256


@dataclass
class LaunchedStep:
    """A launched step's sampled tokens: `tokens` (S,) int64 on the device (what the next step's pending
    tokens come from), `host` their copy in (pinned) host memory, complete when `event` has passed."""

    seq_ids: list[int]
    tokens: torch.Tensor | None = None
    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    # rows that asked for logprobs: (rows, chosen (R,), top values (R, k), top ids (R, k), each row's k), on the host
    logprobs: tuple | None = None

    def read(self) -> dict[int, int]:
        """{seq_id: sampled token}: waits for the step's sampling to reach the host (the step's one sync)."""
        if not self.seq_ids:
            return {}
        if self.event is not None:
            self.event.synchronize()
        return dict(zip(self.seq_ids, self.host.tolist()))

    def read_logprobs(self) -> dict[int, TokenLogprobs]:
        """{seq_id: its token's TokenLogprobs} of the sequences that asked (after read(): on the host by then)."""
        if self.logprobs is None:
            return {}
        rows, chosen, top_v, top_i, ks = self.logprobs
        chosen, top_v, top_i = chosen.tolist(), top_v.tolist(), top_i.tolist()
        return {self.seq_ids[r]: TokenLogprobs(chosen[j], tuple(zip(top_i[j][:k], top_v[j][:k])))
                for j, (r, k) in enumerate(zip(rows, ks))}  # fmt: skip


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
        # the running sequences' block tables (a step holds at most max_num_seqs; the rest: those that just left)
        self._table_rows = BlockTableRows(2 * config.max_num_seqs, self.max_blocks_per_seq, self.pad_block)
        self.model.set_kv_cache((num_blocks + 1) * config.block_size)
        self.forward = self.model
        # invariant: graphs where ops/invariant_kernels.py's Triton kernels take the model (no host sync); the
        # reference path they fall back to reads each sequence's lengths on the host, which no graph can capture
        graphs = config.cuda_graphs and self.on_cuda and (config.invariant is None or self._invariant_kernels())
        if config.cuda_graphs and self.on_cuda and not graphs:
            progress("invariant=%r: steps run without CUDA graphs (its kernels for this model read lengths on the "
                     "host)", config.invariant)  # fmt: skip
        self._pool = torch.cuda.graph_pool_handle() if graphs else None  # shared by every graph of this runner
        self.pieces: PiecewiseGraphs | None = None
        # Compiled at every TP: at TP=1 there is no communication to rewrite, but Inductor fuses the norms,
        # RoPE and activations that would otherwise run as separate eager kernels.
        if config.compile_model:
            # baseline: the plain TP graph (the model's NCCL all-reduces) for A/B runs
            options = PLAIN_TP if config.baseline else CompileOptions()
            if config.invariant is not None:
                options = options.replace({"invariant": config.invariant})
            if graphs and config.piecewise_graphs:
                model = self.model
                self.pieces = PiecewiseGraphs(
                    stable=lambda: itertools.chain(model.parameters(), model.buffers()), pool=self._pool
                )
                options = options.replace({"piecewise_graphs": self.pieces})
            self.forward = compiler.compile(
                self.model,
                options=options,
                sp_min_tokens=config.sp_min_tokens,
                token_split_min_tokens=config.token_split_min_tokens,
            )
            if config.invariant is not None:
                self._first_calls()
        self.prefill_buckets: list[int] = []
        if self.pieces is not None:
            self.prefill_buckets = list(config.prefill_graph_sizes or prefill_buckets(config.max_num_batched_tokens))
        self._row_buckets = decode_buckets(config.max_num_seqs)  # sampled rows of a piecewise step, padded up
        # steps by how they ran, tokens scheduled and padding rows added
        self.step_stats = {"decode_graph": 0, "whole_graph": 0, "piecewise": 0, "eager": 0, "tokens": 0,
                           "padded_tokens": 0}  # fmt: skip
        self.capture_stats: dict[str, float] = {}
        self._last = LaunchedStep([])  # the latest launched step: pending tokens come from its samples
        self._last_rows: dict[int, int] = {}  # seq_id -> row of self._last.tokens
        # Two pinned buffers for sampled tokens, alternating: the one a step copies into was last used two
        # steps before, whose tokens the host has read.
        self._host_tokens = [
            torch.empty(config.max_num_seqs, dtype=torch.int64, pin_memory=self.on_cuda) for _ in range(2)
        ]
        self._num_launched = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._static_out: dict[int, torch.Tensor] = {}  # each decode graph's output (logits of its bucket)
        self.num_graph_replays = 0
        # whole prefill and mixed steps: (token bucket, sequence bucket, every sequence fresh) -> graph, its logits
        # (sequence bucket rows, V); static inputs shared by every graph (views); sequences (the chunks' and the
        # padding rows') padded with empty ones up to a bucket of STEP_SEQ_BUCKETS (an empty sequence still costs
        # the attention kernels a program per head: padding every step to max_num_seqs cost a 2048-token prefill
        # 3% on one H200), block tables to _step_width
        self.step_graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self._step_out: dict[tuple[int, int, bool], torch.Tensor] = {}
        self._step_staged: StagedInputs | None = None
        self._decode_staged: dict[int, StagedInputs] = {}  # decode graph bucket -> its static inputs
        # with graphs: where a step's sampling writes its tokens, (max_num_seqs,) int64 on the device; the next
        # step's graph takes its pending tokens from there
        self._prev_tokens = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=ctx.device) if graphs else None
        top = config.max_num_seqs + 1
        self._seq_buckets = [b for b in STEP_SEQ_BUCKETS if b < top] + [top]
        self._step_width = max([self.max_blocks_per_seq] + [-(-b // self.block_size) for b in self.prefill_buckets])
        whole = self.pieces is not None and config.whole_step_graphs
        if graphs:
            # The largest step first: compiles its graph and sizes symmetric-memory buffers and
            # workspaces for the largest M, so nothing is reallocated under a captured graph.
            self._largest_step(config.max_num_batched_tokens)
            reserved = torch.cuda.memory_reserved(self.ctx.device)
            if whole:
                self._capture_step_graphs(self.prefill_buckets)
            elif self.pieces is not None:
                self._capture_piecewise(self.prefill_buckets)
            start = time.perf_counter()
            self._capture_decode_graphs(decode_buckets(config.max_num_seqs))
            torch.cuda.synchronize(self.ctx.device)
            self.capture_stats["decode_capture_s"] = time.perf_counter() - start
            self.capture_stats["graph_memory_bytes"] = torch.cuda.memory_reserved(self.ctx.device) - reserved

    def release(self) -> None:
        """Drop the CUDA graphs, their outputs and the KV cache (before another runner allocates its own in
        this process); the runner cannot step afterwards."""
        self.graphs.clear()
        self._static_out.clear()
        self._decode_staged.clear()
        self.step_graphs.clear()
        self._step_out.clear()
        if self.pieces is not None:
            self.pieces.release()
        self.model.set_kv_cache(None)

    # -- memory -----------------------------------------------------------------------------------
    def _invariant_kernels(self) -> bool:
        """Whether invariant mode runs on ops/invariant_kernels.py's graph-safe Triton kernels here (either level: the
        "tp" level's products are its tree_matmul): a dtype and head shapes they take."""
        from tpweave.ops import invariant_kernels

        cfg = self.model.config
        q = torch.empty(0, cfg.num_heads, cfg.head_dim, dtype=self.dtype, device=self.ctx.device)
        kv = torch.empty(0, cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype, device=self.ctx.device)
        return invariant_kernels.attention_supported(q, kv)

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
            # fresh=False: the gathering path, the larger peak of a step of this size
            self.model(ids, pos, cu, pos, cu[1:], table, self.block_size, cu[1:] - 1, torch.tensor(False))
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
    def _tables(self, chunks: list[ScheduledChunk], out: np.ndarray) -> np.ndarray:
        """`out` (rows, width) int32 set to the block tables of the chunks' sequences (rows kept across steps:
        engine/block_tables.py), the pad block elsewhere."""
        return self._table_rows.gather([c.seq for c in chunks], out, self.pad_block)

    def _inputs(self, chunks: list[ScheduledChunk], *, pad_to: int | None = None, rows_to: int | None = None) -> tuple:
        """The forward's arguments for a step of any chunks (prefill, mixed): token ids, positions, cu_seqlens,
        KV slots, context lengths, block tables, block size, the row of each chunk's last token, and whether no
        chunk has cached context (a CPU bool: attention over the new K/V alone).

        pad_to: that many token rows, the rows past the chunks' tokens one more sequence of its own (token 0,
        positions from 0, K/V in the pad block, no cached context): what every other sequence computes is
        unchanged. rows_to: that many logits rows, the last chunk's row repeated."""
        *arrays, pending, fresh = self._host_inputs(chunks, pad_to=pad_to, rows_to=rows_to)
        dev = self.ctx.device
        ids, positions, cu, slots, ctx_lens, tables, rows = (torch.from_numpy(a).to(dev, non_blocking=True)
                                                             for a in arrays)  # fmt: skip
        return (self._fill_pending(ids, pending), positions, cu, slots, ctx_lens, tables, self.block_size, rows,
                torch.tensor(fresh))  # fmt: skip

    def _host_inputs(
        self,
        chunks: list[ScheduledChunk],
        *,
        pad_to: int | None = None,
        rows_to: int | None = None,
        seqs_to: int | None = None,
        width_to: int | None = None,
    ) -> tuple:
        """`_inputs`'s tensors as numpy arrays (ids, positions, cu_seqlens int32, slots, context lengths int32,
        block tables int32, rows), then the pending rows (`_pending`) and the fresh bool. seqs_to: that many
        sequences, the ones past the chunks (and the padding rows' sequence) with no tokens and no context;
        width_to: block tables that wide."""
        n, bs = len(chunks), self.block_size
        starts = np.fromiter((c.start for c in chunks), np.int64, n)
        lens = np.fromiter((c.num_tokens for c in chunks), np.int64, n)
        fresh = bool((starts == 0).all())
        rows = np.cumsum(lens) - 1
        pad = 0 if pad_to is None else pad_to - int(lens.sum())
        if pad < 0:
            raise AssertionError(f"a step of {int(lens.sum())} tokens padded to {pad_to}")
        width = max(len(c.seq.block_table) for c in chunks)
        if pad:
            starts, lens = np.append(starts, 0), np.append(lens, pad)
            width = max(width, -(-pad // bs))
        if seqs_to is not None:
            if seqs_to < len(lens):
                raise AssertionError(f"{len(lens)} sequences padded to {seqs_to}")
            empty = np.zeros(seqs_to - len(lens), dtype=np.int64)
            starts, lens = np.append(starts, empty), np.append(lens, empty)
        if width_to is not None:
            if width_to < width:
                raise AssertionError(f"block tables {width} wide padded to {width_to}")
            width = width_to
        cu = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        total = int(cu[-1])
        tokens = itertools.chain.from_iterable(c.seq.tokens(c.start, c.start + c.num_tokens) for c in chunks)
        ids = np.zeros(total, dtype=np.int64)
        ids[: total - pad] = np.fromiter(tokens, np.int64, total - pad)
        owner = np.repeat(np.arange(len(lens)), lens)  # the chunk of every token row
        pending = self._pending(ids, lambda row: chunks[owner[row]].seq.seq_id)
        positions = np.arange(total, dtype=np.int64) - cu[:-1][owner] + starts[owner]
        tables = self._tables(chunks, np.empty((len(lens), width), dtype=np.int32))  # padding rows: the pad block
        if pad:
            positions[total - pad :] %= self.model.config.max_position_embeddings
        slots = tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        if rows_to is not None and rows_to > n:
            rows = np.concatenate([rows, np.full(rows_to - n, rows[-1])])
        return (ids, positions, cu.astype(np.int32), slots, (starts + lens).astype(np.int32), tables, rows, pending,
                fresh)  # fmt: skip

    def _pending(self, ids: np.ndarray, seq_of_row) -> np.ndarray | None:
        """(2, P) rows of `ids` holding PENDING and the rows of the previous step's samples they come from
        (None without any); those ids are set to 0 in place."""
        rows = np.flatnonzero(ids == PENDING)
        if len(rows) == 0:
            return None
        ids[rows] = 0
        src = np.fromiter((self._last_rows[seq_of_row(r)] for r in rows), np.int64, len(rows))
        return np.stack([rows, src])

    def _fill_pending(self, ids_dev: torch.Tensor, pending: np.ndarray | None) -> torch.Tensor:
        """Write the previous step's sampled tokens (on the device) into ids_dev at the pending rows."""
        if pending is not None:
            index = torch.from_numpy(pending).to(ids_dev.device, non_blocking=True)
            ids_dev.index_copy_(0, index[0], self._last.tokens.index_select(0, index[1]))
        return ids_dev

    @staticmethod
    def _write_pending(h: dict[str, np.ndarray], pending: np.ndarray | None, rows: int) -> None:
        """A graph step's `take` and `src` fields (its first `rows` rows) from `_pending`'s rows."""
        take, src = h["take"][:rows], h["src"][:rows]
        take.fill(False)
        src.fill(0)
        if pending is not None:
            take[pending[0]] = True
            src[pending[0]] = pending[1]

    def _take_pending(self, ids: torch.Tensor, take: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Inside a graph: the token ids with the pending rows (`take`) read from the previous step's samples (their
        rows `src` of self._prev_tokens)."""
        return torch.where(take, self._prev_tokens.index_select(0, src), ids)

    # -- CUDA graphs of decode steps ----------------------------------------------------------------
    def _decode_fields(self, bucket: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """A decode graph's static inputs (StagedInputs fields) for `bucket` rows."""
        row, i64 = (bucket,), torch.int64
        return {"ids": (row, i64), "pos": (row, i64), "slots": (row, i64), "src": (row, i64),
                "ctx_lens": (row, torch.int32), "take": (row, torch.bool),
                "tables": ((bucket, self.max_blocks_per_seq), torch.int32)}  # fmt: skip

    def _write_decode_inputs(self, chunks: list[ScheduledChunk], h: dict[str, np.ndarray]) -> None:
        """A decode step's inputs padded to the rows of `h` (the fields of _decode_fields, written in place); pad
        rows use the pad block. A pending token id reads 0, its row `take`n from row `src` of the previous step's
        samples by the graph."""
        n, bs, ids, pos = len(chunks), self.block_size, h["ids"], h["pos"]
        bucket = len(ids)
        assert n <= bucket, (n, bucket)  # the caller picked a bucket that holds the batch
        pos[n:] = 0
        pos[:n] = np.fromiter((c.start for c in chunks), np.int64, n)
        ids[n:] = 0
        ids[:n] = np.fromiter((c.seq.token_at(c.start) for c in chunks), np.int64, n)
        self._write_pending(h, self._pending(ids, lambda row: chunks[row].seq.seq_id), bucket)
        tables = self._tables(chunks, h["tables"])
        h["slots"][:] = tables[np.arange(bucket), pos // bs].astype(np.int64) * bs + pos % bs  # pad rows: pad block
        h["ctx_lens"][:] = pos + 1

    def decode_inputs(self, bucket: int) -> dict[str, torch.Tensor]:
        """The static inputs on the device of the decode graph of `bucket` rows (what a replay reads)."""
        return self._decode_staged[bucket].dev

    def _dummy_args(self, num_tokens: int) -> tuple:
        """The forward's arguments for a prefill step of num_tokens tokens in two sequences (one sequence would
        make Dynamo specialize the batch dim to 1, and every other step compile another graph) whose K/V all go
        to the pad block."""
        dev, bs = self.ctx.device, self.block_size
        first = max(num_tokens // 2, 1)
        lens = [first, num_tokens - first] if num_tokens >= 2 else [num_tokens]
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
        pos = torch.cat([torch.arange(n, device=dev) for n in lens])
        slots = self.pad_block * bs + pos % bs
        tables = torch.full((len(lens), -(-max(lens) // bs)), self.pad_block, dtype=torch.int32, device=dev)
        positions = pos % self.model.config.max_position_embeddings
        ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        return ids, positions, cu, slots, cu[1:] - cu[:-1], tables, bs, cu[1:].long() - 1, torch.tensor(False)

    @torch.no_grad()
    def _first_calls(self) -> None:
        """Invariant mode: each graph variant first called at a token count the config fixes. Inductor picks a
        reduction's kernel configuration (rows per program, warps: the order of a row's sum) from the size hint of its
        rows, the M its graph was first called with; engines of other token budgets (their largest or first step of
        another M) would otherwise reduce a norm's row in other orders. Two sequences of a block and a token each (no
        block-table dim of size 1, which Dynamo would specialize), within the variant's range."""
        m = 2 * (self.block_size + 1)
        for low, high in self.forward.variant_ranges().values():
            self.forward(*self._dummy_args(max(low, m if high is None else min(m, high - 1))))

    @torch.no_grad()
    def _largest_step(self, num_tokens: int) -> None:
        """One prefill step of num_tokens tokens (`_dummy_args`), eagerly: compiles its graph, sizes workspaces."""
        self.forward(*self._dummy_args(num_tokens))
        torch.cuda.synchronize(self.ctx.device)

    @torch.no_grad()
    def _capture_piecewise(self, buckets: list[int]) -> None:
        """The pieces of a prefill step of every bucket's token count captured, largest first."""
        progress("capturing piecewise CUDA graphs for %d prefill sizes (up to %d tokens)", len(buckets), max(buckets))
        start = time.perf_counter()
        for num_tokens in sorted(buckets, reverse=True):
            with self.pieces.replaying():
                self.forward(*self._dummy_args(num_tokens))
        torch.cuda.synchronize(self.ctx.device)
        self.capture_stats["piecewise_capture_s"] = time.perf_counter() - start
        self.capture_stats["piecewise_graphs"] = self.pieces.num_graphs

    def _step_seq_buckets(self, num_tokens: int) -> list[int]:
        """The sequence buckets of a step of num_tokens rows (at most num_tokens + 1 sequences: the padding rows'):
        those up to the first that holds that many."""
        buckets = self._seq_buckets
        return [b for i, b in enumerate(buckets) if i == 0 or buckets[i - 1] < num_tokens + 1]

    @staticmethod
    def _step_seqs(num_tokens: int, seq_bucket: int) -> int:
        """Sequences of a whole-step graph: the bucket, one more where a step of T tokens would have T sequences
        (the attention op takes that for a decode step: ops/attention.py)."""
        return seq_bucket + 1 if seq_bucket == num_tokens else seq_bucket

    @torch.no_grad()
    def _capture_step_graphs(self, buckets: list[int]) -> None:
        """A graph of the whole forward per token bucket, sequence bucket and kind (fresh or not), largest first, on
        inputs of one sequence of that many tokens in the pad block and empty ones."""
        keys = [(t, b) for t in sorted(buckets, reverse=True) for b in self._step_seq_buckets(t)]
        progress("capturing CUDA graphs of whole prefill and mixed steps: %d token x sequence sizes (up to %d tokens)",
                 len(keys), max(buckets))  # fmt: skip
        start, dev, bs = time.perf_counter(), self.ctx.device, self.block_size
        top, seqs, rows = max(buckets), self.config.max_num_seqs + 2, self.config.max_num_seqs + 1
        i64, i32 = torch.int64, torch.int32
        # the step's arrays (_host_inputs) in its order, then the pending rows; block tables last: a step sends the
        # buffer up to its tables' last row
        self._step_staged = StagedInputs(
            {"ids": ((top,), i64), "pos": ((top,), i64), "cu": ((seqs + 1,), i32), "slots": ((top,), i64),
             "ctx_lens": ((seqs,), i32), "rows": ((rows,), i64), "src": ((top,), i64), "take": ((top,), torch.bool),
             "tables": ((seqs, self._step_width), i32)},
            dev,
        )  # fmt: skip
        d = self._step_staged.dev
        d["pos"].copy_(torch.arange(top, device=dev) % self.model.config.max_position_embeddings)
        d["slots"].copy_(self.pad_block * bs + d["pos"] % bs)
        d["tables"].fill_(self.pad_block)
        for bucket, seq_bucket in keys:
            d["cu"][1:].fill_(bucket)
            d["ctx_lens"].zero_()
            d["ctx_lens"][0] = bucket
            for fresh in (False, True):
                self._step_forward(bucket, seq_bucket, fresh)  # warm-up (compiles for new shapes before the capture)
                torch.cuda.synchronize(dev)
                if self.ctx.world_size > 1:
                    dist.barrier(group=self.ctx.group)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    out = self._step_forward(bucket, seq_bucket, fresh)
                # the logits held without keeping their memory: the next captures reuse it (a step's logits are
                # read before any other graph replays); kept, hundreds of graphs' logits took 7 GiB for llama3-8b
                self._step_out[(bucket, seq_bucket, fresh)] = weak_alias(out)
                del out
                self.step_graphs[(bucket, seq_bucket, fresh)] = graph
        torch.cuda.synchronize(dev)
        self.capture_stats["step_capture_s"] = time.perf_counter() - start
        self.capture_stats["step_graphs"] = len(self.step_graphs)

    def _step_forward(self, bucket: int, seq_bucket: int, fresh: bool) -> torch.Tensor:
        """The forward of a whole step on the static inputs (what its graph captures)."""
        d, n = self._step_staged.dev, self._step_seqs(bucket, seq_bucket)
        ids = self._take_pending(d["ids"][:bucket], d["take"][:bucket], d["src"][:bucket])
        return self.forward(ids, d["pos"][:bucket], d["cu"][: n + 1], d["slots"][:bucket], d["ctx_lens"][:n],
                            d["tables"][:n], self.block_size, d["rows"][:seq_bucket], torch.tensor(fresh))  # fmt: skip

    def whole_step(self, chunks: list[ScheduledChunk]) -> tuple[int, Callable[[], torch.Tensor]] | None:
        """(the token bucket, a callable that runs this prefill or mixed step from its graph of the whole forward:
        the inputs copied into the graph's, the graph replayed, the logits rows of the chunks returned), or None
        where no such graph serves the step. The inputs are built on the host here, copied when it is called."""
        if not self.step_graphs or len(chunks) > self.config.max_num_seqs:
            return None
        num_tokens = sum(c.num_tokens for c in chunks)
        bucket = bucket_for(self.prefill_buckets, num_tokens)
        if bucket is None:
            return None
        seq_bucket = bucket_for(self._seq_buckets, len(chunks) + (bucket > num_tokens))
        *arrays, pending, fresh = self._host_inputs(chunks, pad_to=bucket, rows_to=seq_bucket,
                                                    seqs_to=self._step_seqs(bucket, seq_bucket),
                                                    width_to=self._step_width)  # fmt: skip
        key = (bucket, seq_bucket, fresh)
        graph, out = self.step_graphs[key], self._step_out[key]

        def run() -> torch.Tensor:
            staged = self._step_staged
            h = staged.host()
            for name, a in zip(("ids", "pos", "cu", "slots", "ctx_lens", "tables", "rows"), arrays):
                h[name][: len(a)] = a
            self._write_pending(h, pending, bucket)
            staged.upload(staged.end_of("tables", len(arrays[5])))
            graph.replay()
            self.num_graph_replays += 1
            return out[: len(chunks)]

        return bucket, run

    def _capture_decode_graphs(self, buckets: list[int]) -> None:
        progress("capturing decode CUDA graphs for %d batch sizes (up to %d)", len(buckets), max(buckets))
        dev, top = self.ctx.device, max(buckets)
        self._static_cu = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self._static_rows = torch.arange(top, device=dev)  # int64, like the eager path's rows
        self._not_fresh = torch.tensor(False)  # decode: every sequence has context
        with torch.no_grad():
            for bucket in sorted(buckets, reverse=True):  # largest first: workspaces sized once
                staged = self._decode_staged[bucket] = StagedInputs(self._decode_fields(bucket), dev)
                self._write_decode_inputs([], staged.host())
                staged.upload()
                self._decode_forward(bucket)  # warm-up (compiles on the first bucket)
                torch.cuda.synchronize(dev)
                if self.ctx.world_size > 1:
                    dist.barrier(group=self.ctx.group)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    self._static_out[bucket] = self._decode_forward(bucket)
                self.graphs[bucket] = graph
        self._buckets = sorted(buckets)

    def _decode_forward(self, bucket: int) -> torch.Tensor:
        """The forward of a decode step on the static inputs of `bucket` rows (what its graph captures)."""
        d = self._decode_staged[bucket].dev
        return self.forward(self._take_pending(d["ids"], d["take"], d["src"]), d["pos"],
                            self._static_cu[: bucket + 1], d["slots"], d["ctx_lens"], d["tables"], self.block_size,
                            self._static_rows[:bucket], self._not_fresh)  # fmt: skip

    def _decode_with_graph(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        if not self.graphs or any(c.num_tokens != 1 for c in chunks) or len(chunks) > self._buckets[-1]:
            return None
        if max(len(c.seq.block_table) for c in chunks) > self.max_blocks_per_seq:
            return None
        bucket = bucket_for(self._buckets, len(chunks))
        staged = self._decode_staged[bucket]
        self._write_decode_inputs(chunks, staged.host())
        staged.upload()
        self.graphs[bucket].replay()
        self.num_graph_replays += 1
        return self._static_out[bucket][: len(chunks)]

    # -- the step -----------------------------------------------------------------------------------
    def _stream(self, params, seq) -> int:
        """The random stream of a request: its seed mixed with its sequence id, so that requests of one seed differ;
        with invariant="batch" and a seed given, the seed alone (the same draws whatever came in before it)."""
        if self.config.invariant is not None and params.seed is not None:
            return params.seed
        return (params.seed or 0) * 1_000_003 + seq.seq_id

    @torch.no_grad()
    def launch(self, chunks: list[ScheduledChunk]) -> LaunchedStep:
        """Queue the step's forward and sampling on the device without waiting for either; the returned
        LaunchedStep reads the sampled tokens (of the chunks that sample) when the host needs them."""
        sampling = [(b, c) for b, c in enumerate(chunks) if c.samples]
        if not chunks:
            return LaunchedStep([])
        logits = self._decode_with_graph(chunks)
        num_tokens = sum(c.num_tokens for c in chunks)
        self.step_stats["tokens"] += num_tokens
        if logits is not None:
            self.step_stats["decode_graph"] += 1
        else:
            whole = self.whole_step(chunks)
            bucket = bucket_for(self.prefill_buckets, num_tokens) if self.pieces is not None else None
            if whole is not None:
                self.step_stats["whole_graph"] += 1
                self.step_stats["padded_tokens"] += whole[0] - num_tokens
                logits = whole[1]()
            elif bucket is None:
                self.step_stats["eager"] += 1
                logits = self.forward(*self._inputs(chunks))  # (B, V): the last row of each chunk
            else:
                self.step_stats["piecewise"] += 1
                self.step_stats["padded_tokens"] += bucket - num_tokens
                rows = bucket_for(self._row_buckets, len(chunks)) or len(chunks)
                with self.pieces.replaying():
                    logits = self.forward(*self._inputs(chunks, pad_to=bucket, rows_to=rows))[: len(chunks)]
        if not sampling:
            return LaunchedStep([])
        dev = logits.device

        def put(values, dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        picked = logits if len(sampling) == len(chunks) else logits[put([b for b, _ in sampling], torch.int64)]
        params = [c.seq.params for _, c in sampling]
        if any(p.temperature > 0 for p in params):
            # a request's draw depends on its seed and on how many tokens it generated before this one; its sequence
            # id (the order requests came in) is mixed in, except where invariance asks for the seed alone
            seeds = [request_seed(self._stream(p, c.seq), c.seq.num_generated - 1)
                     for p, (_, c) in zip(params, sampling)]  # fmt: skip
            tokens = sample(
                picked.float(),
                put([p.temperature for p in params], torch.float32),
                put([p.top_p for p in params], torch.float32),
                put(seeds, torch.int64),
            )
            if self._prev_tokens is not None:
                tokens = self._prev_tokens[: len(params)].copy_(tokens)
        elif self._prev_tokens is not None:
            tokens = torch.argmax(picked, -1, out=self._prev_tokens[: len(params)])
        else:
            tokens = picked.argmax(-1)
        seq_ids = [c.seq.seq_id for _, c in sampling]
        self._last_rows = {sid: i for i, sid in enumerate(seq_ids)}
        logprobs = self._logprobs(picked, tokens, params, put)
        if not self.on_cuda:
            self._last = LaunchedStep(seq_ids, tokens, tokens, logprobs=logprobs)
            return self._last
        host = self._host_tokens[self._num_launched % 2][: len(seq_ids)]
        self._num_launched += 1
        host.copy_(tokens, non_blocking=True)
        if logprobs is not None:  # to the host behind the same event as the tokens (pinned: the host does not wait)
            pinned = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x, non_blocking=True)
                      for x in logprobs[1:4]]  # fmt: skip
            logprobs = (logprobs[0], *pinned, logprobs[4])
        event = torch.cuda.Event()
        event.record()
        self._last = LaunchedStep(seq_ids, tokens, host, event, logprobs)
        return self._last

    @staticmethod
    def _logprobs(picked: torch.Tensor, tokens: torch.Tensor, params: list, put) -> tuple | None:
        """The sampled tokens' log-probabilities under the model and the top k of the rows that asked (None: none
        did), on the logits' device: log_softmax over the vocabulary in fp32, one row at a time whatever the batch
        (a row's reduction depends on the vocabulary's size alone), so in invariant mode as invariant as the logits."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return None
        ks = [params[i].logprobs for i in rows]
        index = put(rows, torch.int64) if len(rows) < len(params) else None
        lp = torch.log_softmax((picked if index is None else picked[index]).float(), dim=-1)
        chosen = lp.gather(-1, (tokens if index is None else tokens[index])[:, None])[:, 0]
        top_v, top_i = lp.topk(max(ks), dim=-1)
        return rows, chosen, top_v, top_i, ks
