"""`tpweave bench engine`: the reference engine against the limits of its GPU.

Decode, per batch B at context C: the engine's step in steady state (B sequences decoding from the
first step on, their contexts centered on C over the timed steps; wall time between consecutive
step() returns: host work, launch and the wait for the device, as a client sees it) next to the
forward alone (the decode CUDA graph of that step replayed back to back) and the HBM roofline (every
weight byte once + the K/V the step reads, at the GPU's HBM bandwidth). Kernels per step come from
torch.profiler over steady steps. Prefill of N tokens: the forward as the engine runs it (its piecewise CUDA graphs
replayed, calls back to back: the prefill throughput; one call from an idle GPU beside it) next to the whole forward
captured in one CUDA graph and replayed (what the engine's launch costs over it), the compiled forward launched
without graphs, the matmul roofline (its FLOPs at the median of the bf16 GEMM rates sampled from cold at the start of
the run, the plateau before the power limit lowers the clocks; at the run's single highest sample beside it)
and the datasheet's dense peak of a known GPU, and the engine's time for a one-token request of N prompt tokens.
Mixed steps (B decodes at context C beside one fresh chunk of N tokens): the same three timings. The record has
what the graphs cost: capture seconds, the memory the captures reserved, the graphs, the padding per step.

Every torch.profiler use (kernel counts and kernel time) runs after every timing of the run, so no timing runs in a
process the profiler has touched (one H200, benchmarks/probes/mixed_host_probe.py: a 32-layer mixed step's host time
was 14.9 ms before cProfile and torch.profiler ran in the process and 27 ms after; which of them, not isolated)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpweave.bench.kernels import categorize
from tpweave.bench.stats import median, paired_ratio
from tpweave.bench.timing import capture, time_call
from tpweave.engine import LLMEngine, SamplingParams
from tpweave.engine.buckets import bucket_for
from tpweave.engine.scheduler import ScheduledChunk
from tpweave.engine.sequence import Sequence
from tpweave.log import progress
from tpweave.models.config import DTYPES
from tpweave.runtime.context import TPContext

REPLAYS_PER_SAMPLE = 5  # back to back between two events: a replay's launch hides behind the one before
DECODE_ROUNDS = 4  # a decode row's engine steps and forward replays, each timed in this many rounds, interleaved
# prefill forwards back to back per sample, as a stream of prefill steps runs (the host prepares and launches the next
# one while the GPU runs this one); one call from an idle GPU is reported beside it (single_call_ms)
CALLS_PER_PREFILL_SAMPLE = 3
# Vendor datasheet figures by the words of a GPU's name (an H100 SXM names itself "NVIDIA H100 80GB HBM3").
# HBM bandwidth, bytes/s (other GPUs: the copy bandwidth measured in the run):
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 HBM3": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "A100": 2.0e12}
# dense bf16 tensor-core FLOP/s: a limit that does not move with the GPU's clocks, so prefill rows of different runs
# and GPUs compare on it
BF16_DENSE_FLOPS = {
    "H200": 989.4e12, "H100 HBM3": 989.4e12, "H100 NVL": 835.5e12, "H100 PCIe": 756.5e12, "A100": 312e12,
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class EngineBenchSettings:
    """Shapes and repetitions: decode batches at `context` tokens, prefill token counts, `steps` timed engine
    steps per batch (after `warmup_steps`; the decode forward gets as many samples, interleaved with them),
    `replays` // 5 repetitions of a prefill or mixed step's arms."""

    batches: tuple[int, ...] = (1, 64, 256)
    context: int = 1024
    prefill: tuple[int, ...] = (2048,)
    mixed: tuple[tuple[int, int, int], ...] = ((64, 1024, 512),)  # (decodes, their context, new chunk tokens)
    steps: int = 64
    warmup_steps: int = 8
    replays: int = 50


def _datasheet(device: torch.device, table: dict[str, float]) -> tuple[float, str] | None:
    """(figure, its key) of the first entry whose words all appear in the GPU's name, else None."""
    name = torch.cuda.get_device_name(device)
    for key, value in table.items():
        if all(part in name for part in key.split()):
            return value, key
    return None


def hbm_bandwidth(device: torch.device) -> tuple[float, str]:
    """(bytes/s, where it comes from): the datasheet figure of a known GPU, else a measured device copy."""
    known = _datasheet(device, HBM_BYTES_PER_S)
    if known is not None:
        return known[0], f"datasheet ({known[1]})"
    return copy_bandwidth(device), "measured copy"


def copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Bytes/s of a device-to-device copy of nbytes (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _event_ms(lambda: dst.copy_(src), reps=20)
    return 2 * nbytes / (median(ms) / 1e3)


class MatmulRate:
    """Samples of the FLOP/s of an n x n x n matmul in dtype (three back to back per sample): the practical matmul
    peak of this GPU."""

    def __init__(self, device: torch.device, dtype: torch.dtype, n: int = 8192):
        self.n = n
        self.a = torch.randn(n, n, device=device, dtype=dtype)
        self.b = torch.randn(n, n, device=device, dtype=dtype)
        self.a @ self.b

    def rate(self) -> float:
        """One sample, FLOP/s."""
        ms = time_call(lambda: [self.a @ self.b for _ in range(3)], inner=1, on_cuda=True) / 3
        return 2 * self.n**3 / (ms / 1e3)

    def samples(self, count: int) -> list[float]:
        """`count` samples back to back, FLOP/s."""
        return [self.rate() for _ in range(count)]


def gemm_flops_per_s(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    """The highest of 20 MatmulRate samples back to back: the matmul rate this GPU reaches (the samples after it
    are already slowed by its power limit)."""
    return max(MatmulRate(device, dtype, n).samples(20))


def _event_ms(fn, *, reps: int, warmup: int = 3) -> list[float]:
    """Per-call milliseconds of fn, `reps` samples of one call each (bench/timing.py time_call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return [time_call(fn, inner=1, on_cuda=True) for _ in range(reps)]


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights: every parameter once, except the embedding table (a
    step reads B of its rows) unless the LM head shares it."""
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head.weight is not embed:
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes(model: torch.nn.Module, context_lens: list[int]) -> int:
    """Bytes of K and V a decode step reads for sequences of these context lengths (this rank's kv heads)."""
    attn = model.model.layers[0].self_attn
    per_token = 2 * attn.num_kv_heads * attn.head_dim * attn.k_cache.element_size()
    return per_token * sum(context_lens) * len(model.model.layers)


def prefill_flops(model: torch.nn.Module, num_tokens: int) -> float:
    """FLOPs of one fresh sequence of num_tokens: every decoder matmul over all rows, the LM head over the
    last row, causal attention (QK^T and PV over the lower triangle) in every layer."""
    layers = model.model.layers
    linear = sum(
        m.weight.numel() for layer in layers for m in layer.modules() if hasattr(m, "weight") and m.weight.dim() == 2
    )
    attn = layers[0].self_attn
    attention = 2 * 2 * (num_tokens * (num_tokens + 1) / 2) * attn.num_heads * attn.head_dim * len(layers)
    return 2 * linear * num_tokens + 2 * model.lm_head.weight.numel() + attention


def count_kernels(fn, *, calls: int) -> tuple[float, dict[str, int], dict[str, float], float]:
    """Per call of fn: device kernels (torch.profiler, kernels inside CUDA-graph replays included; copies
    and memsets not counted), and milliseconds of kernel time by kind (gemm, attention, other); the
    kernel names with their counts over all calls; and copies and memsets per call."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    names: dict[str, int] = {}
    ms = {"gemm": 0.0, "attention": 0.0, "other": 0.0}  # bench/kernels.py categories, the rest as "other"
    copies = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if e.name.lower().startswith(("memcpy", "memset")):
            copies += 1
            continue
        names[e.name] = names.get(e.name, 0) + 1
        category = categorize(e.name)
        ms[category if category in ms else "other"] += e.time_range.elapsed_us() / 1e3 / calls
    return sum(names.values()) / calls, dict(sorted(names.items(), key=lambda kv: -kv[1])), ms, copies / calls


def _decoding(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> Sequence:
    """A request placed in decode state: all but its last prompt token counted as in the KV cache (blocks
    allocated, contents not computed: a decode step costs the same whatever the cached values), so every
    step from the first is a decode step at the prompt's full context."""
    seq = engine.add_request(prompt, params)
    engine.scheduler.blocks.grow(seq, len(prompt) - 1)
    seq.num_computed_tokens = len(prompt) - 1
    return seq


def _rewind_graph_inputs(runner, bucket: int, batch: int, context: int) -> list[int]:
    """Set the first `batch` rows of the static inputs of the decode graph of `bucket` rows (left by the engine's
    last step) to a step at `context` tokens per sequence, in the same blocks; their context lengths."""
    d = runner.decode_inputs(bucket)
    pos, slots, ctx_lens, tables = (d[k][:batch] for k in ("pos", "slots", "ctx_lens", "tables"))
    bs = runner.block_size
    d["take"].fill_(False)  # token ids as they are: none taken from the previous step's samples
    pos.fill_(context - 1)
    ctx_lens.fill_(context)
    slots.copy_(tables.gather(1, (pos // bs)[:, None]).squeeze(1).long() * bs + pos % bs)
    return ctx_lens.tolist()


def _decode_rows(
    ctx: TPContext, engine: LLMEngine, settings: EngineBenchSettings, hbm: float, later: list
) -> list[dict]:
    """Decode rows; what torch.profiler measures of them appended to `later` (module doc: why after every timing)."""
    rows = []
    model, runner = engine.runner.model, engine.runner
    rng = random.Random(0)
    for batch in sorted(settings.batches, reverse=True):
        progress("decode batch %d at context %d: engine steps", batch, settings.context)
        prompt_len = settings.context - settings.warmup_steps - (settings.steps + DECODE_ROUNDS) // 2  # centered
        params = SamplingParams(max_tokens=settings.warmup_steps + settings.steps + DECODE_ROUNDS + 8)
        seqs = [_decoding(engine, [rng.randrange(engine.vocab_size) for _ in range(prompt_len)], params)
                for _ in range(batch)]  # fmt: skip
        for _ in range(settings.warmup_steps):
            engine.step()
        first_context = seqs[0].num_tokens
        bucket = bucket_for(sorted(runner.graphs), batch)
        graph = runner.graphs[bucket] if bucket is not None else None
        # The forward alone: the decode graph that runs these steps, its inputs as the engine's last step left them,
        # positions set to a context (values only: what a replay writes lands in these sequences' own blocks or the
        # pad block, and the engine's next step sends all its inputs again). Timed in rounds between the steps'
        # rounds, in an order shuffled per round, each forward at the middle context of its round's steps: a step's
        # cost grows with its context, in jumps (llama3-8b at batch 256 on one H200: steps of 14.8 ms up to context
        # ~1024, 15.3 ms after it), and the steps' clocks under this load must be the forward's too.
        step_ms, fwd_ms, contexts = [], [], []  # contexts: each forward round's context lengths

        def time_steps(n: int) -> None:
            engine.step()  # refills the pipeline of async scheduling after the forward's round drained it
            t = time.perf_counter()
            for _ in range(n):
                engine.step()
                now = time.perf_counter()
                step_ms.append((now - t) * 1e3)
                t = now

        def time_forward(n: int, context: int) -> None:
            torch.cuda.synchronize()
            contexts.append(_rewind_graph_inputs(runner, bucket, batch, context))
            for t in _event_ms(lambda: [graph.replay() for _ in range(REPLAYS_PER_SAMPLE)], reps=n, warmup=1):
                fwd_ms.append(t / REPLAYS_PER_SAMPLE)

        order = ["steps", "forward"] if graph is not None else ["steps"]
        rounds = []  # each step sample's round
        for r in range(DECODE_ROUNDS):
            rng.shuffle(order)
            n = settings.steps // DECODE_ROUNDS + (r < settings.steps % DECODE_ROUNDS)
            rounds += [r] * n
            middle = seqs[0].num_tokens + 1 + (n + 1) // 2  # of the n timed steps after the untimed one
            for arm in order:
                if arm == "steps":
                    time_steps(n)
                else:
                    time_forward(n, middle)  # as many samples as the round's steps: paired by round below
        timed_context = (first_context + seqs[0].num_tokens) / 2  # mean context of the timed steps
        assert all(s.finish_reason is None for s in seqs), "a sequence ended while its steps were timed"
        while engine.has_unfinished():
            engine.step()
        row: dict[str, Any] = {
            "what": "engine_decode",
            "batch": batch,
            "context": settings.context,
            "step_ms": median(step_ms),
            "step_ms_p90": float(np.percentile(step_ms, 90)),
            "step_ms_samples": step_ms,
        }
        later.append(lambda row=row, batch=batch: row.update(_step_kernels(engine, batch, settings)))
        if graph is not None:
            kv = float(np.mean([kv_bytes(model, lens) for lens in contexts]))
            roofline = (model_bytes(model) + kv) / hbm * 1e3
            row |= {
                "graph_bucket": bucket,
                "forward_context": round(float(np.mean(contexts))),
                "forward_ms": median(fwd_ms),
                "forward_ms_samples": fwd_ms,
                "step_over_forward": median(step_ms) / median(fwd_ms),
                # its 95% interval: a bootstrap over the rounds, then the samples within each
                "step_over_forward_ci": _interval(step_ms, fwd_ms, rounds),
                "roofline_ms": roofline,
                "of_roofline": roofline / median(fwd_ms),
            }

            def graph_kernels(row=row, batch=batch, bucket=bucket, graph=graph, context=timed_context):
                _rewind_graph_inputs(runner, bucket, batch, round(context))
                kernels_fwd, names, kind_ms, _ = count_kernels(graph.replay, calls=2)
                row.update(kernels_per_forward=kernels_fwd, **{f"{k}_ms": v for k, v in kind_ms.items()},
                           forward_kernels=names)  # fmt: skip

            later.append(graph_kernels)
        rows.append(row)
    return rows


def _step_kernels(engine: LLMEngine, batch: int, settings: EngineBenchSettings) -> dict[str, float]:
    """Kernels, and copies and memsets, per engine step of `batch` sequences decoding at settings.context
    (torch.profiler over 4 steps): kernels_per_step, copies_per_step."""
    rng = random.Random(0)
    params = SamplingParams(max_tokens=16)
    for _ in range(batch):
        _decoding(engine, [rng.randrange(engine.vocab_size) for _ in range(settings.context)], params)
    for _ in range(2):
        engine.step()
    kernels, _, _, copies = count_kernels(engine.step, calls=4)
    while engine.has_unfinished():
        engine.step()
    return {"kernels_per_step": kernels, "copies_per_step": copies}


def _interval(base_ms: list[float], arm_ms: list[float], groups: list[int] | None = None) -> dict[str, float]:
    """The 95% interval of median(base) / median(arm), samples paired by index (bench/stats.py paired_ratio; with
    `groups`, each sample's round: rounds resampled, then samples within them)."""
    r = paired_ratio(base_ms, arm_ms, groups=groups)
    return {"lo": r.lo, "hi": r.hi}


def _peak_bytes(fn) -> int:
    """Bytes fn allocated at its peak beyond what was allocated before it (graph pools' memory not counted: a
    replay allocates nothing)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _step_timings(
    runner, args: tuple, *, calls: int, reps: int, rng: random.Random, sample=None, whole=None
) -> tuple[dict[str, Any], list, Any]:
    """One step's forward (args: `runner._inputs` of the step, padded as the engine pads it), interleaved per
    repetition: as the engine runs it (`whole`, from runner.whole_step: its inputs copied into its graph of the whole
    step and that graph replayed; else its piecewise graphs replayed; back to back and one call from an idle GPU),
    the whole forward in one CUDA graph replayed back to back, and the compiled forward without graphs (one call).
    The arms' order is shuffled per repetition (`rng`). `sample()` runs once per repetition (the matmul rate between
    samples). (row fields, sample()'s results, a callable giving the kernel fields: torch.profiler, to run after every
    timing of the run)"""

    def eager():
        return runner.forward(*args)

    def engine_path():
        if whole is not None:
            return whole()
        if runner.pieces is None:
            return eager()
        with runner.pieces.replaying():
            return runner.forward(*args)

    for _ in range(2):
        engine_path()
        eager()
    graph_replay = capture(eager, None)  # the pieces run as compiled inside it: the whole forward, attention too

    def back_to_back(fn) -> float:
        return time_call(lambda: [fn() for _ in range(calls)], inner=1, on_cuda=True) / calls

    arms = {
        "graph_forward_ms": lambda: back_to_back(graph_replay),
        "forward_ms": lambda: back_to_back(engine_path),
        "single_call_ms": lambda: time_call(engine_path, inner=1, on_cuda=True),
        "eager_single_ms": lambda: time_call(eager, inner=1, on_cuda=True),
    }
    out: dict[str, list[float]] = {k: [] for k in arms}
    samples, order = [], list(arms)
    for _ in range(reps):
        # a new order per repetition: a measurement right after a slow eager call (the GPU idle between its kernels)
        # ran at higher clocks than one after back-to-back replays, and a fixed order gave one arm that edge each time
        rng.shuffle(order)
        for name in order:
            out[name].append(arms[name]())
        if sample is not None:
            samples.append(sample())
    row: dict[str, Any] = {key: median(values) for key, values in out.items()}
    row |= {f"{key}_samples": values for key, values in out.items()}
    row["single_over_graph"] = row["single_call_ms"] / row["graph_forward_ms"]
    row["single_over_graph_ci"] = _interval(out["single_call_ms"], out["graph_forward_ms"])  # paired by repetition
    row["forward_over_graph"] = row["forward_ms"] / row["graph_forward_ms"]
    row["peak_bytes_eager"] = _peak_bytes(eager)
    row["peak_bytes_engine"] = _peak_bytes(engine_path)
    # where a step's time goes beyond its kernels: the host's time to launch it (no wait), and the kernel time of the
    # engine's path and of the whole-forward graph (their difference to the timings: gaps between kernels)
    host = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine_path()
        host.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    row["host_ms"] = median(host)

    def kernels() -> dict[str, Any]:
        with torch.no_grad():
            _, _, graph_kind_ms, _ = count_kernels(graph_replay, calls=2)
            _, names, kind_ms, _ = count_kernels(engine_path, calls=2)
        return {"graph_kernel_ms": sum(graph_kind_ms.values()), "kernel_ms": sum(kind_ms.values()),
                **{f"{kind}_ms": v for kind, v in kind_ms.items()}, "forward_kernels": names}  # fmt: skip

    return row, samples, kernels


def _path(runner, whole) -> str:
    """How the engine runs a prefill or mixed step: "whole-step graph", "piecewise" graphs or "eager"."""
    return "whole-step graph" if whole is not None else "piecewise" if runner.pieces is not None else "eager"


def _padding(runner, num_tokens: int) -> int:
    """The token count the engine pads a step of num_tokens to (itself when it runs without piecewise graphs)."""
    return bucket_for(runner.prefill_buckets, num_tokens) or num_tokens if runner.pieces is not None else num_tokens


def _prefill_rows(ctx, engine: LLMEngine, settings: EngineBenchSettings, cold: list[float], later: list) -> list[dict]:
    rows = []
    matmul = MatmulRate(ctx.device, engine.runner.dtype)
    runner, model = engine.runner, engine.runner.model
    rng = random.Random(1)
    for num_tokens in settings.prefill:
        progress("prefill of %d tokens", num_tokens)
        prompt = [rng.randrange(engine.vocab_size) for _ in range(num_tokens)]
        seq = Sequence(prompt)
        engine.scheduler.blocks.grow(seq, num_tokens)
        padded = _padding(runner, num_tokens)
        chunks = [ScheduledChunk(seq, 0, num_tokens, samples=True)]
        args = runner._inputs(chunks, pad_to=padded)
        whole = runner.whole_step(chunks)
        # the matmul rate sampled between the forward's samples too: under this sustained load the GPU's power limit
        # lowers its clocks (an H200 measured 628-697 TFLOP/s here against 793 from cold)
        with torch.no_grad():  # as the engine runs it (grad mode is part of the compiled graph's guards)
            timing, peaks, kernels = _step_timings(
                runner, args, calls=CALLS_PER_PREFILL_SAMPLE, reps=max(settings.replays // 5, 5),
                rng=random.Random(num_tokens), sample=matmul.rate, whole=whole and whole[1],
            )  # fmt: skip
        engine.scheduler.blocks.free(seq)
        step_ms = []
        for _ in range(max(settings.replays // 5, 5)):
            t = time.perf_counter()
            engine.generate([prompt], SamplingParams(max_tokens=1))
            step_ms.append((time.perf_counter() - t) * 1e3)
        # the yardstick: the median of the cold samples (the plateau before the power limit lowers the clocks); the
        # single highest sample of the run beside it
        rate = median(cold)
        flops = prefill_flops(model, num_tokens)
        roofline = flops / rate * 1e3
        datasheet = _datasheet(ctx.device, BF16_DENSE_FLOPS) if engine.runner.dtype == torch.bfloat16 else None
        fwd = timing["forward_ms"]
        rows.append({
            "what": "engine_prefill",
            "tokens": num_tokens,
            "padded_to": padded,
            "path": _path(runner, whole),
            **timing,
            "request_ms": median(step_ms),
            "request_ms_samples": step_ms,
            "roofline_ms": roofline,
            "of_roofline": roofline / fwd,
            "tokens_per_s": num_tokens / (fwd / 1e3),
            "matmul_flops_per_s": rate,
            "matmul_flops_per_s_highest": max(cold + peaks),
            "of_roofline_at_highest": flops / max(cold + peaks) * 1e3 / fwd,
            "matmul_flops_per_s_cold_samples": cold,
            "matmul_flops_per_s_under_load": median(peaks),
            "matmul_flops_per_s_under_load_samples": peaks,
            "datasheet_flops_per_s": datasheet[0] if datasheet else None,
            "of_datasheet_peak": flops / datasheet[0] * 1e3 / fwd if datasheet else None,
        })  # fmt: skip
        later.append(lambda row=rows[-1], kernels=kernels: row.update(kernels()))
    return rows


def _mixed_rows(engine: LLMEngine, settings: EngineBenchSettings, later: list) -> list[dict]:
    """One step of B decodes at context C beside a fresh chunk of N tokens (contents of the cached context not
    computed: a step costs the same whatever its values)."""
    rows = []
    runner, rng = engine.runner, random.Random(2)
    for decodes, context, chunk in settings.mixed:
        progress("mixed step: %d decodes at context %d + a %d-token chunk", decodes, context, chunk)
        chunks = []
        for _ in range(decodes):
            seq = Sequence([rng.randrange(engine.vocab_size) for _ in range(context)])
            engine.scheduler.blocks.grow(seq, context)
            chunks.append(ScheduledChunk(seq, context - 1, 1, samples=True))
        seq = Sequence([rng.randrange(engine.vocab_size) for _ in range(chunk)])
        engine.scheduler.blocks.grow(seq, chunk)
        chunks.append(ScheduledChunk(seq, 0, chunk, samples=True))
        num_tokens = decodes + chunk
        padded = _padding(runner, num_tokens)
        args = runner._inputs(chunks, pad_to=padded)
        whole = runner.whole_step(chunks)
        with torch.no_grad():
            timing, _, kernels = _step_timings(
                runner, args, calls=CALLS_PER_PREFILL_SAMPLE, reps=max(settings.replays // 5, 5),
                rng=random.Random(num_tokens), whole=whole and whole[1],
            )  # fmt: skip
        for c in chunks:
            engine.scheduler.blocks.free(c.seq)
        rows.append({"what": "engine_mixed", "decodes": decodes, "context": context, "chunk": chunk,
                     "tokens": num_tokens, "padded_to": padded, "path": _path(runner, whole), **timing})  # fmt: skip
        later.append(lambda row=rows[-1], kernels=kernels: row.update(kernels()))
    return rows


def bench_engine(
    ctx: TPContext,
    model: str,
    *,
    dtype_name: str,
    num_layers: int | None,
    settings: EngineBenchSettings,
    engine_kwargs: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows, record): rows of kind engine_decode and engine_prefill; the record has the limits used (HBM
    bandwidth and its source, the measured matmul rate), the engine's build time and its compile report."""
    dtype = DTYPES[dtype_name]
    overrides = {"num_layers": num_layers} if num_layers else {}
    max_len = max([settings.context + 64] + [c + 8 for _, c, _ in settings.mixed])
    mixed_tokens = [b + n for b, _, n in settings.mixed]
    kwargs = dict(
        dtype=dtype,
        max_num_seqs=max(settings.batches + tuple(b + 1 for b, _, _ in settings.mixed)),
        max_num_batched_tokens=max(max(settings.prefill, default=0), max(settings.batches), *mixed_tokens, 2048),
        max_model_len=max(max_len, max(settings.prefill, default=0) + 8),
        **overrides,
        **(engine_kwargs or {}),
    )
    t = time.perf_counter()
    engine = LLMEngine(ctx, model, **kwargs)
    build_s = time.perf_counter() - t
    dev = ctx.device
    hbm, hbm_source = hbm_bandwidth(dev)
    cold = MatmulRate(dev, dtype).samples(20)
    later: list = []  # torch.profiler's measurements, after every timing (module doc)
    rows = _decode_rows(ctx, engine, settings, hbm, later) + _prefill_rows(ctx, engine, settings, cold, later)
    rows += _mixed_rows(engine, settings, later)
    progress("kernel counts and times (torch.profiler) of %d measurements", len(later))
    for measure in later:
        measure()
    report = getattr(engine.runner.forward, "compile_report", None)
    runner = engine.runner
    steps = runner.step_stats
    graphs = {
        **runner.capture_stats,
        "piecewise": runner.pieces.stats() if runner.pieces is not None else None,
        "prefill_buckets": list(runner.prefill_buckets),
        "steps": dict(steps),
        "padded_tokens_per_step": steps["padded_tokens"] / max(steps["piecewise"] + steps["whole_graph"], 1),
        "padded_fraction": steps["padded_tokens"] / max(steps["tokens"], 1),
    }
    record = {
        "hbm_bytes_per_s": hbm,
        "hbm_source": hbm_source,
        "copy_bytes_per_s": copy_bandwidth(dev),
        "matmul_flops_per_s": median(cold),  # the cold plateau at the start of the run (prefill rows: the yardstick)
        "matmul_flops_per_s_samples": cold,
        "engine_build_s": build_s,
        "graphs": graphs,
        "engine": {k: str(v) for k, v in kwargs.items()},
        "async_scheduling": engine.config.async_scheduling,
        "compile_report": report.to_dict() if report is not None else None,
        "fallbacks": report.fallbacks() if report is not None else [],
    }
    engine.release()
    return rows, record
