"""Functions the tests run on every rank through tpweave.launch (importable by spawned workers)."""

from __future__ import annotations

import functools
import os
import signal
import time

import torch

from tpweave.models import build_model
from tpweave.models.config import DTYPES
from tpweave.models.inputs import random_batch, split_tokens
from tpweave.ops import collectives


def compile_strict(model, **kwargs):
    """tpweave.compile with strict=True unless the caller says otherwise: a failure inside tpweave's own
    passes fails the test instead of compiling without them."""
    import tpweave

    return tpweave.compile(model, **{"strict": True, **kwargs})


def batch_for(num_tokens: int, *, vocab_size: int, device, seed: int = 0):
    return random_batch(split_tokens(num_tokens, 3), vocab_size=vocab_size, seed=seed + num_tokens, device=device)


@torch.no_grad()
def eager_logits(ctx, source, token_counts, dtype_names=("float32",), seed=0, **overrides):
    """{(dtype, M): logits on CPU} for the model built on this rank."""
    out = {}
    for name in dtype_names:
        model = build_model(source, tp=ctx, dtype=DTYPES[name], seed=seed, **overrides)
        for m in token_counts:
            batch = batch_for(m, vocab_size=model.config.vocab_size, device=ctx.device)
            out[(name, m)] = model(*batch.args()).float().cpu()
    return out


@torch.no_grad()
def collectives_and_logits(ctx, source, num_tokens, seed=0):
    """(names of the distributed ops one eager forward dispatched, logits on CPU) of the model on this rank."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if func.namespace in ("_c10d_functional", "c10d") or any(
                word in name for word in ("all_reduce", "gather", "scatter")
            ):
                self.names.append(name)
            return func(*args, **(kwargs or {}))

    model = build_model(source, tp=ctx, dtype=torch.float32, seed=seed)
    batch = batch_for(num_tokens, vocab_size=model.config.vocab_size, device=ctx.device)
    with Record() as record:
        logits = model(*batch.args())
    return record.names, logits.cpu()


def state_dict_cpu(ctx, source, seed=0, dtype_name="float32"):
    model = build_model(source, tp=ctx, dtype=DTYPES[dtype_name], seed=seed)
    return {k: v.cpu() for k, v in model.state_dict().items()}


def build_with_rank_seed(ctx):
    build_model("tiny", tp=ctx, dtype=torch.float32, seed=ctx.rank)


def raise_on_rank(ctx, bad_rank):
    if ctx.rank == bad_rank:
        raise ValueError(f"boom from rank {ctx.rank}")
    torch.distributed.barrier()
    return ctx.rank


def die_on_rank(ctx, bad_rank):
    if ctx.rank == bad_rank:
        os._exit(3)
    torch.distributed.barrier()
    return ctx.rank


def killed_on_rank(ctx, bad_rank):
    """The bad rank is killed as the out-of-memory killer kills a process: SIGKILL, nothing reported."""
    if ctx.rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    torch.distributed.barrier()
    return ctx.rank


def symm_wait_timeout_ms(ctx):
    from tpweave.ops import symm_buffers

    return symm_buffers.wait_timeout_ms(ctx.group_name)


def hang_on_rank(ctx, bad_rank):
    if ctx.rank == bad_rank:
        time.sleep(3600)
    return ctx.rank


def env_and_parent(ctx, name):
    """A variable of this rank's environment and its parent process (the launcher if spawned, else the fork server)."""
    return os.environ.get(name), os.getppid()


def write_pid_and_sleep(ctx, directory):
    path = os.path.join(directory, f"rank{ctx.rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path + ".pid")  # the test reads a .pid file only once it is complete
    time.sleep(3600)


def token_collectives(ctx, token_counts, feature_shape):
    """For each M: (reduce_scatter then all_gather) and all_reduce of the same rank-dependent input."""
    out = {}
    for m in token_counts:
        x = torch.arange(m * torch.Size(feature_shape).numel(), dtype=torch.float32).reshape(m, *feature_shape)
        x = (x + 1000 * ctx.rank).to(ctx.device)
        reduced = collectives.all_reduce(x.clone(), ctx.group_name)
        shard = torch.ops.tpweave.reduce_scatter_tokens(x, 1, ctx.group_name, ctx.world_size)
        gathered = torch.ops.tpweave.all_gather_tokens(shard, [m], ctx.group_name, ctx.world_size)
        local = torch.ops.tpweave.shard_tokens(reduced, 1, ctx.rank, ctx.world_size)
        out[m] = (reduced.cpu(), gathered.cpu(), shard.cpu(), local.cpu())
    return out


def compiled_collectives_recompiles(ctx, token_counts):
    """Compile RS -> token-wise op -> AG with M dynamic; return (#compilations, max error) over all M."""
    num_compiles = 0

    def backend(gm, example_inputs):
        nonlocal num_compiles
        num_compiles += 1
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    def f(x):
        shard = torch.ops.tpweave.reduce_scatter_tokens(x, 1, ctx.group_name, ctx.world_size)
        y = torch.nn.functional.silu(shard) * 2
        return torch.ops.tpweave.all_gather_tokens(y, [x.shape[0]], ctx.group_name, ctx.world_size)

    from tpweave.compiler.dynamic import mark_tokens_dynamic, token_dynamic_config

    cf = torch.compile(f, backend=backend)
    worst = 0.0
    with token_dynamic_config():
        for m in token_counts:
            x = torch.randn(m, 8, generator=torch.Generator().manual_seed(m)).to(ctx.device) + ctx.rank
            mark_tokens_dynamic([x])
            ref = torch.nn.functional.silu(collectives.all_reduce(x.clone(), ctx.group_name)) * 2
            worst = max(worst, float((cf(x) - ref).abs().max()))
    return num_compiles, worst


def _batch_shapes_ids(shapes, vocab, device):
    return [
        torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(sum(shape) * 7 + len(shape))).to(device)
        for shape in shapes
    ]


@torch.no_grad()
def flat_mlp_invariant_logits(ctx, level="tp"):
    """tests/foreign_models' model with its MLP on the tokens flattened (a Hugging Face MoE block's shared expert),
    compiled with invariant=level, strict, SP from 16 tokens: a sequence's logits alone and as the first row of
    batches of 3 and 6 (120 and 240 tokens), the eager model's, and the report's swaps."""
    import foreign_models
    import tpweave

    torch._dynamo.reset()
    model = foreign_models.ForeignModel(ctx.rank, ctx.world_size, flat_mlp=True)
    compiled = compile_strict(model, invariant=level, sp_min_tokens=16)
    ids = torch.randint(1, foreign_models.VOCAB, (6, 40), generator=torch.Generator().manual_seed(0))
    outs = [compiled(ids[:n])[0] for n in (1, 3, 6)]
    swaps = [g.invariant for g in tpweave.report(compiled).graphs]
    return outs, model(ids[:1])[0], swaps, dict(compiled.calls)


@torch.no_grad()
def foreign_model_outputs(
    ctx,
    shapes,
    compile_kwargs=None,
    seed=0,
    fail_pass=False,
    fail_inductor=False,
    model_name="ForeignModel",
    **model_kwargs,
):
    """Eager (and, if compile_kwargs is given, compiled) outputs of a model of tests/foreign_models."""
    import foreign_models
    import tpweave
    from foreign_models import VOCAB

    model = getattr(foreign_models, model_name)(ctx.rank, ctx.world_size, seed=seed, **model_kwargs)
    inputs = _batch_shapes_ids(shapes, VOCAB, ctx.device)
    result = {"eager": [model(ids).cpu() for ids in inputs]}
    if compile_kwargs is not None:
        if fail_pass:
            from tpweave.compiler import sequence_parallel

            def broken(self):
                raise RuntimeError("injected pass failure")

            sequence_parallel.SequenceParallelPass.run = broken
        if fail_inductor:
            import torch._inductor.compile_fx as inductor

            def broken_inductor(*args, **kwargs):
                raise RuntimeError("injected Inductor failure")

            inductor.compile_fx = broken_inductor
        compiled = compile_strict(model, **{"strict": not fail_pass, **compile_kwargs})
        result["compiled"] = [compiled(ids).cpu() for ids in inputs]
        rep = tpweave.report(compiled)
        result["report"] = str(rep)
        result["num_compiles"] = rep.num_compiles
        result["graphs"] = [
            (g.variant, g.counts_before, g.counts_after, [(s.kind, s.action, s.reason) for s in g.sites], g.notes)
            for g in rep.graphs
        ]
        result["calls"] = dict(compiled.calls)
        result["schedules"] = [list(g.schedule) for g in rep.graphs]
    return result


def foreign_cases_outputs(ctx, cases, compile_kwargs):
    """foreign_model_outputs of each (shapes, model kwargs) case on one set of ranks, Dynamo reset between them."""
    outs = []
    for shapes, model_kwargs in cases:
        torch._dynamo.reset()
        outs.append(foreign_model_outputs(ctx, shapes, compile_kwargs, **model_kwargs))
    return outs


@torch.no_grad()
def graphs_per_call(ctx, model_name, shapes, compile_kwargs=None):
    """Compiled and eager logits of a model called with `shapes` in order, and the graphs each call
    compiled. model_name: a tests/foreign_models class (shapes are (batch, seq) token ids) or a tpweave
    preset (shapes are token counts M, one layer)."""
    import foreign_models
    import tpweave

    if hasattr(foreign_models, model_name):
        model = getattr(foreign_models, model_name)(ctx.rank, ctx.world_size, seed=0)
        inputs = [(ids,) for ids in _batch_shapes_ids(shapes, foreign_models.VOCAB, ctx.device)]
    else:
        model = build_model(model_name, tp=ctx, dtype=torch.float32, num_layers=1)
        inputs = [batch_for(m, vocab_size=model.config.vocab_size, device=ctx.device).args() for m in shapes]
    compiled = tpweave.compile(model, **(compile_kwargs or {"sp_min_tokens": 0}))
    rep = tpweave.report(compiled)
    out = {"compiled": [], "eager": [], "new_graphs": []}
    for args in inputs:
        before = rep.num_compiles
        out["compiled"].append(compiled(*args).float().cpu())
        out["new_graphs"].append(rep.num_compiles - before)
        out["eager"].append(model(*args).float().cpu())
    out["report"] = str(rep)
    out["notes"] = list(rep.notes) + [n for g in rep.graphs for n in g.notes if "failed" in n]
    return out


@torch.no_grad()
def llama_compiled_outputs(
    ctx, source, token_counts, dtype_names=("float32",), compile_kwargs=None, seed=0, **overrides
):
    """For each dtype: compiled and eager logits for every M, plus the report."""
    import tpweave

    out = {}
    for name in dtype_names:
        model = build_model(source, tp=ctx, dtype=DTYPES[name], seed=seed, **overrides)
        compiled = compile_strict(model, **(compile_kwargs or {"sp_min_tokens": 0}))
        for m in token_counts:
            batch = batch_for(m, vocab_size=model.config.vocab_size, device=ctx.device)
            out[(name, m, "compiled")] = compiled(*batch.args()).float().cpu()
            out[(name, m, "eager")] = model(*batch.args()).float().cpu()
        rep = tpweave.report(compiled)
        out[(name, "report")] = str(rep)
        out[(name, "graphs")] = [
            (g.variant, g.counts_before, g.counts_after, [(s.kind, s.action, s.reason) for s in g.sites])
            for g in rep.graphs
        ]
        out[(name, "serves")] = [g.serves for g in rep.graphs]
        out[(name, "schedules")] = [(g.variant, list(g.schedule), list(g.notes)) for g in rep.graphs]
        out[(name, "num_compiles")] = rep.num_compiles
        out[(name, "strategies_at_1")] = sorted(compiled.strategies_at(1))
    return out


def compile_errors(ctx):

    model = build_model("tiny", tp=ctx, dtype=torch.float32, num_layers=1)
    messages = {}
    compiled = compile_strict(model, sp_min_tokens=0)
    empty = random_batch([1], vocab_size=model.config.vocab_size)
    try:
        compiled(empty.input_ids[:0], empty.positions[:0], empty.cu_seqlens)
    except ValueError as e:
        messages["empty"] = str(e)
    try:
        compile_strict(model, sp_min_tokens=-1)
    except ValueError as e:
        messages["negative"] = str(e)
    try:  # one rank with other options (e.g. a calibration table only it found): refused, not a hang
        compile_strict(model, sp_min_tokens=64 if ctx.rank else 0)
    except ValueError as e:
        messages["disagree"] = str(e)
    return messages


@torch.no_grad()
def gpu_sp_vs_plain(ctx, preset, token_counts, cudagraphs, num_layers=2):
    """Logits of the SP + async-TP graph and of the plain TP graph, each one compiled graph for all M."""
    import tpweave

    model = build_model(preset, tp=ctx, dtype=torch.bfloat16, num_layers=num_layers)
    sp = compile_strict(model, sp=True, sp_min_tokens=0, cudagraphs=cudagraphs)
    plain = compile_strict(model, sp=False, cudagraphs=cudagraphs)
    out = {}
    for m in token_counts:
        batch = batch_for(m, vocab_size=model.config.vocab_size, device=ctx.device)
        for name, fn in (("sp", sp), ("plain", plain)):
            for _ in range(2 if cudagraphs else 1):  # with CUDA graphs: record, then replay
                logits = fn(*batch.args())
            out[(name, m)] = logits.float().cpu()
    out["num_compiles_sp"] = tpweave.report(sp).num_compiles
    out["num_compiles_plain"] = tpweave.report(plain).num_compiles
    out["report"] = str(tpweave.report(sp))
    return out


@torch.no_grad()
def gpu_piecewise(ctx, preset, token_counts, num_layers=2):
    """SP + async TP with Inductor graph partition at tpweave::attention and CUDA graphs per partition."""
    from torch._inductor.utils import run_and_get_code

    import tpweave

    model = build_model(preset, tp=ctx, dtype=torch.bfloat16, num_layers=num_layers)
    piecewise = compile_strict(model, sp=True, sp_min_tokens=0, cudagraphs=True, piecewise=True)
    plain = compile_strict(model, sp=False)
    out = {}
    for i, m in enumerate(token_counts):
        batch = batch_for(m, vocab_size=model.config.vocab_size, device=ctx.device)
        if i == 0:
            logits, code = run_and_get_code(piecewise, *batch.args())
            out["num_partitions"] = max(c.count("def partition_") for c in code)
        for _ in range(2):
            logits = piecewise(*batch.args())
        out[("piecewise", m)] = logits.float().cpu()
        out[("plain", m)] = plain(*batch.args()).float().cpu()
    out["num_compiles"] = tpweave.report(piecewise).num_compiles
    return out


@torch.no_grad()
def gpu_strategy_outputs(ctx, token_counts, k, n, dtype_name="bfloat16"):
    """ag_mm and mm_rs under every registered strategy, against the sequential one."""
    from tpweave.ops.strategies import STRATEGIES

    dtype = DTYPES[dtype_name]
    out = {}
    for m in token_counts:
        gen = torch.Generator(device=ctx.device).manual_seed(m)
        rows = collectives.shard_rows(m, ctx.world_size)
        x_local = torch.randn(rows, k, device=ctx.device, dtype=dtype, generator=gen) + ctx.rank
        w = torch.randn(n, k, device=ctx.device, dtype=dtype, generator=gen).t() * k**-0.5
        a = torch.randn(m, n, device=ctx.device, dtype=dtype, generator=gen) + ctx.rank
        w2 = torch.randn(k, n, device=ctx.device, dtype=dtype, generator=gen).t() * n**-0.5
        for name, strategy in STRATEGIES.items():
            if strategy.ag_mm is not None:
                ag = torch.ops.tpweave.ag_mm(
                    x_local, [w, w[:, : n // 2]], [None, None], [m], ctx.group_name, ctx.world_size, name
                )
                rs = torch.ops.tpweave.mm_rs(a, w2, ctx.group_name, ctx.world_size, name)
                out[(name, m)] = [t.float().cpu() for t in ag] + [rs.float().cpu()]
            if strategy.ag_scaled_mm is not None and dtype == torch.bfloat16:
                from tpweave.ops import fp8

                xq, xs = fp8.quantize_rows(x_local)
                wq, ws = fp8.quantize_weight(w.t(), per_channel=True)
                aq, as_ = fp8.quantize_rows(a)
                w2q, w2s = fp8.quantize_weight(w2.t(), per_channel=True)
                ag = torch.ops.tpweave.ag_scaled_mm(
                    xq, xs, [wq], [ws], [None], [m], ctx.group_name, ctx.world_size, dtype, name
                )
                rs = torch.ops.tpweave.scaled_mm_rs(aq, as_, w2q, w2s, ctx.group_name, ctx.world_size, dtype, name)
                out[(name, m, "fp8")] = [t.float().cpu() for t in ag] + [rs.float().cpu()]
            if strategy.all_reduce is not None:
                out[(name, m, "all_reduce")] = (
                    torch.ops.tpweave.all_reduce(a, ctx.group_name, ctx.world_size, name).float().cpu()
                )
        out[("nccl", m, "all_reduce")] = collectives.all_reduce(a.clone(), ctx.group_name).float().cpu()
    return out


@torch.no_grad()
def style_outputs(ctx, styles, token_counts, compile_model=True, compile_kwargs=None):
    """{style: ([eager outputs], [compiled outputs], report)} for tests/style_models.StyleModel."""
    import tpweave
    from style_models import StyleModel, V

    results = {}
    for style in styles:
        model = StyleModel(ctx.rank, ctx.world_size, style)
        inputs = [torch.randint(0, V, (m,), generator=torch.Generator().manual_seed(m)) for m in token_counts]
        flat = lambda o: [t.clone() for t in (o if isinstance(o, tuple) else (o,))]  # noqa: E731
        eager = [flat(model(ids)) for ids in inputs]
        compiled_out, rep = None, None
        if compile_model:
            # each style is a model of its own; the styles share StyleModel.forward's recompile limit
            torch._dynamo.reset()
            compiled = compile_strict(model, **(compile_kwargs or {"sp_min_tokens": 0}))
            compiled_out = [flat(compiled(ids)) for ids in inputs]
            rep = tpweave.report(compiled)
            rep = (
                rep.num_compiles,
                [
                    (g.counts_before, g.counts_after, [(s.kind, s.action, s.reason) for s in g.sites])
                    for g in rep.graphs
                ],
                str(rep),
                [(s.kind, s.action, s.reason) for g in rep.graphs for s in g.sites],
            )
        results[style] = (eager, compiled_out, rep)
    return results


@torch.no_grad()
def reported_dynamo_limits(ctx, token_counts):
    """A model with a graph break, then Dynamo's recompile limit (set to 1 here) shared by three models
    of one class: {name: ([(compiled, eager) outputs], notes, num_compiles)}."""
    import tpweave
    from style_models import StyleModel, V

    inputs = [torch.randint(0, V, (m,), generator=torch.Generator().manual_seed(m)) for m in token_counts]
    results = {}
    for name, style, limit in (("graph_break", "graph_break", None), ("prenorm", "prenorm", 1), ("gemma", "gemma", 1)):
        if name == "prenorm":
            torch._dynamo.reset()  # the graph-break model's entries would count against the limit below
        with torch._dynamo.config.patch(recompile_limit=limit or torch._dynamo.config.recompile_limit):
            # both variants of "prenorm" fit (tpweave scales the limit by its variants); "gemma"'s are too many
            model = StyleModel(ctx.rank, ctx.world_size, style)
            compiled = compile_strict(model, sp_min_tokens=4)
            outs = [(compiled(ids), model(ids)) for ids in inputs]
        rep = tpweave.report(compiled)
        results[name] = (outs, list(rep.notes), rep.num_compiles, [(g.variant, g.counts_after) for g in rep.graphs])
    return results


def engine_generate(
    ctx, prompts, max_tokens, engine_kwargs, temperature=0.0, stop_token_ids=(), with_calls=False, pad_to=None
):
    """pad_to: prefill and mixed steps padded up to these token counts, as for piecewise CUDA graphs (none on a
    CPU: the padding alone); then the runner's step counts come back too."""
    import torch

    import tpweave
    from tpweave.compiler.piecewise import PiecewiseGraphs
    from tpweave.engine import LLMEngine, SamplingParams

    torch._dynamo.reset()  # engines built one after another in a process: each compiles afresh
    engine = LLMEngine(ctx, "tiny", **engine_kwargs)
    if pad_to is not None:
        engine.runner.pieces, engine.runner.prefill_buckets = PiecewiseGraphs(), list(pad_to)
    params = SamplingParams(
        temperature=temperature,
        top_p=0.9,
        max_tokens=max_tokens,
        seed=3,
        stop_token_ids=tuple(stop_token_ids),
        logprobs=2,
    )
    results = engine.generate(prompts, params)
    forward = engine.runner.forward
    num_compiles = tpweave.report(forward).num_compiles if hasattr(forward, "compile_report") else 0
    if with_calls:  # how many steps each graph variant served
        return results, engine.num_steps, num_compiles, dict(forward.calls)
    if pad_to is not None:
        return results, engine.num_steps, num_compiles, dict(engine.runner.step_stats)
    return results, engine.num_steps, num_compiles


def gpu_engine_generate(ctx, model, prompts, max_tokens, engine_kwargs):
    """Greedy generation on the GPU engine; with teacher-forced reference checks done elsewhere."""
    from tpweave.engine import LLMEngine, SamplingParams

    engine = LLMEngine(ctx, model, **engine_kwargs)
    results = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    runner = engine.runner
    return results, {
        "num_graphs": len(runner.graphs),
        "num_graph_replays": runner.num_graph_replays,
        "num_blocks": runner.num_blocks,
        "num_steps": engine.num_steps,
    }


def gpu_teacher_forced(ctx, model, sequences, num_layers=None):
    """TP=1 eager logits over prompt + generated tokens: argmax and top-2 margin at every generated position."""
    import torch

    from tpweave.models import build_model

    overrides = {"num_layers": num_layers} if num_layers else {}
    net = build_model(model, tp=ctx, dtype=torch.bfloat16, seed=0, **overrides)
    out = []
    with torch.no_grad():
        for prompt, generated in sequences:
            ids = torch.tensor(prompt + generated, device=ctx.device)
            cu = torch.tensor([0, len(ids)], dtype=torch.int32, device=ctx.device)
            logits = net(ids, torch.arange(len(ids), device=ctx.device), cu).float()[len(prompt) - 1 : -1]
            top = logits.topk(2, dim=-1)
            out.append((top.indices[:, 0].tolist(), (top.values[:, 0] - top.values[:, 1]).tolist()))
    return out


@torch.no_grad()
def fp8_outputs(ctx, source, token_counts, compile_model=True, **overrides):
    """Eager (and compiled SP) logits of a bf16 FP8 model, and the dtypes of the communicated tensors."""
    import tpweave

    model = build_model(source, tp=ctx, dtype=torch.bfloat16, seed=0, **overrides)
    compiled = compile_strict(model, sp=True, sp_min_tokens=0) if compile_model else None
    out = {}
    for m in token_counts:
        batch = batch_for(m, vocab_size=model.config.vocab_size, device=ctx.device)
        out[(m, "eager")] = model(*batch.args()).float().cpu()
        if compiled is not None:
            out[(m, "compiled")] = compiled(*batch.args()).float().cpu()
    if compiled is not None:
        rep = tpweave.report(compiled)
        out["sites"] = [(s.kind, s.action, s.reason, s.dtype) for g in rep.graphs for s in g.sites]
        out["gathered_bytes_per_token"] = sum(g.gathered_bytes_per_token for g in rep.graphs)
        out["num_compiles"] = rep.num_compiles
    return out


def capture_graph(fn):
    """(CUDA graph, fn's outputs captured in it)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _draw(seed, *shape, device, dtype=torch.bfloat16):
    return torch.randn(*shape, device=device, dtype=dtype, generator=torch.Generator(device=device).manual_seed(seed))


def _fingerprint(t):
    """An integer that differs when any bit of t does (ranks compare their outputs without a collective)."""
    bits = t.contiguous().view(-1).view(torch.int16).to(torch.int64)
    return int((bits * (torch.arange(bits.numel(), device=t.device) % 65521 + 1)).sum())


@torch.no_grad()
def gpu_all_reduce_rms_norm(ctx, token_counts, hidden_sizes, names=None):
    """tpweave::all_reduce_rms_norm under every strategy that serves it (or `names`) vs the sum of every
    rank's input + the reference add + norm (each rank draws every rank's input from seeds); then each
    triton kernel captured in a CUDA graph and replayed on new data, interleaved with eager calls."""
    from tpweave.ops import rms_norm
    from tpweave.ops.strategies import STRATEGIES

    if names is None:
        names = [
            n
            for n, s in STRATEGIES.items()
            if (s.all_reduce_rms_norm or s.all_reduce) and s.available(torch.empty(0, device=ctx.device))
        ]
    out = {"names": names, "worst": {}, "h_fingerprint": {}}

    def partials(m, hidden, seed):
        """(this rank's partial sum, the sum over ranks rounded like the kernel: fp32 sum, one rounding)"""
        xs = [_draw(seed * 97 + r, m, hidden, device=ctx.device) for r in range(ctx.world_size)]
        return xs[ctx.rank], sum(x.float() for x in xs).to(torch.bfloat16)

    for hidden in hidden_sizes:
        for m in token_counts:
            x, summed = partials(m, hidden, m * 31 + hidden)
            res = _draw(m * 31 + hidden + 7, m, hidden, device=ctx.device)
            w = (
                torch.rand(
                    hidden,
                    device=ctx.device,
                    dtype=torch.bfloat16,
                    generator=torch.Generator(device=ctx.device).manual_seed(m),
                )
                + 0.5
            )
            for residual in (res, None):
                for in_fp32 in (False, True):
                    want = rms_norm.add_rms_norm_reference(summed, residual, w, eps=1e-5, weight_in_fp32=in_fp32)
                    for name in names:
                        got = torch.ops.tpweave.all_reduce_rms_norm(
                            x, residual, w, 1e-5, in_fp32, ctx.group_name, ctx.world_size, name
                        )
                        key = (name, hidden, m, residual is not None, in_fp32)
                        out["worst"][key] = max(float((g.float() - r.float()).abs().max()) for g, r in zip(got, want))
                        out["h_fingerprint"][key] = _fingerprint(got[1])
    # CUDA graph: the barrier protocols must survive replays (signal pads reset, or call numbers kept
    # on the device), interleaved with eager calls of the same M on the same buffers
    out["graph_worst"] = {}
    hidden = hidden_sizes[0]
    for name in [n for n in names if n.startswith("triton_")]:
        worst = 0.0
        for m in (8, 200):
            x = torch.zeros(m, hidden, device=ctx.device, dtype=torch.bfloat16)
            res = torch.zeros_like(x)
            w = torch.ones(hidden, device=ctx.device, dtype=torch.bfloat16)
            op = functools.partial(
                torch.ops.tpweave.all_reduce_rms_norm, x, res, w, 1e-5, False, ctx.group_name, ctx.world_size, name
            )
            op()
            graph, (y_g, h_g) = capture_graph(op)
            for step in range(20):
                x_new, summed = partials(m, hidden, 1000 + step)
                x.copy_(x_new)
                res.copy_(_draw(2000 + step, m, hidden, device=ctx.device))
                graph.replay()
                want = rms_norm.add_rms_norm_reference(summed, res, w, eps=1e-5, weight_in_fp32=False)
                worst = max(
                    worst,
                    float((y_g.float() - want[0].float()).abs().max()),
                    float((h_g.float() - want[1].float()).abs().max()),
                )
                if step % 5 == 4:  # an eager call in between: the next replay finds the buffers one call on
                    op()
            del graph
        out["graph_worst"][name] = worst
    return out


@torch.no_grad()
def gpu_side_stream_ar_norm(ctx, token_counts, hidden, sms_counts):
    """The token-split graph's fused all-reduce + residual + RMSNorm on a side stream
    (tpweave::all_reduce_rms_norm_start, then _wait after a matmul on the current stream), against the sum of
    every rank's input + the reference add + norm: eager, with the inputs dropped and their memory written over
    between start and wait (the op must keep them alive), and captured in a CUDA graph with two subsets in flight
    at once (A started, B started, A waited, B waited: the token-split order), replayed on new data.
    Returns {(M, num_sms, "eager" | "graph"): worst error}."""
    from tpweave.ops import rms_norm

    ops, dev, out = torch.ops.tpweave, ctx.device, {}
    w = torch.rand(hidden, device=dev, dtype=torch.bfloat16, generator=torch.Generator(device=dev).manual_seed(3)) + 0.5
    big = _draw(5, 2048, 2048, device=dev)

    def inputs(m, seed):
        xs = [_draw(seed * 97 + r, m, hidden, device=dev) for r in range(ctx.world_size)]
        res = _draw(seed * 97 + 50, m, hidden, device=dev)
        want = rms_norm.add_rms_norm_reference(sum(x.float() for x in xs).to(torch.bfloat16), res, w, eps=1e-5,
                                               weight_in_fp32=False)  # fmt: skip
        return xs[ctx.rank], res, want

    def err(got, want):
        return max(float((g.float() - r.float()).abs().max()) for g, r in zip(got, want))

    for m in token_counts:
        for sms in sms_counts:
            worst = 0.0
            for step in range(3):
                x, res, want = inputs(m, m * 10 + step)
                y, h = ops.all_reduce_rms_norm_start(x.clone(), res.clone(), w, 1e-5, False, ctx.group_name,
                                                     ctx.world_size, sms)  # fmt: skip
                junk = [torch.full_like(x, float("nan")) for _ in range(4)]  # reuses the clones' memory if freed
                _ = big @ big  # the other subset's matmul, on the current stream
                # the clones (the kernel's inputs) have no reference left here: only the op keeps them alive
                ops.all_reduce_rms_norm_wait(y, h, x, res, w, ctx.group_name, ctx.world_size)
                worst = max(worst, err((y, h), want))
                del junk
            out[(m, sms, "eager")] = worst
            xa, ra, xb, rb = (torch.zeros(m, hidden, device=dev, dtype=torch.bfloat16) for _ in range(4))

            def two_subsets():
                ya, ha = ops.all_reduce_rms_norm_start(xa, ra, w, 1e-5, False, ctx.group_name, ctx.world_size, sms)
                _ = big @ big
                yb, hb = ops.all_reduce_rms_norm_start(xb, rb, w, 1e-5, False, ctx.group_name, ctx.world_size, sms)
                ops.all_reduce_rms_norm_wait(ya, ha, xa, ra, w, ctx.group_name, ctx.world_size)
                _ = big @ big
                ops.all_reduce_rms_norm_wait(yb, hb, xb, rb, w, ctx.group_name, ctx.world_size)
                return [t.clone() for t in (ya, ha, yb, hb)]

            two_subsets()
            graph, got = capture_graph(two_subsets)
            worst = 0.0
            for step in range(8):
                x1, r1, want1 = inputs(m, 500 + step)
                x2, r2, want2 = inputs(m, 900 + step)
                for dst, src in ((xa, x1), (ra, r1), (xb, x2), (rb, r2)):
                    dst.copy_(src)
                graph.replay()
                worst = max(worst, err(got[:2], want1), err(got[2:], want2))
            del graph
            out[(m, sms, "graph")] = worst
    return out


@torch.no_grad()
def gpu_peer_never_arrives(ctx, name, log_path):
    """One call of strategy `name` on every rank, then rank 0 calls it again after its peers left (a
    peer that died): its kernel must stop the process with a message once the group's timeout passed,
    not spin forever. Rank 0 returns (seconds until the error, the error, what the GPU printed)."""
    import torch.distributed as dist

    from tpweave.ops import symm_buffers

    x = _draw(1, 64, 4096, device=ctx.device)
    w = torch.ones(4096, device=ctx.device, dtype=torch.bfloat16)
    if name.startswith("triton_ar_norm"):
        call = lambda: torch.ops.tpweave.all_reduce_rms_norm(x, x, w, 1e-5, False, ctx.group_name, ctx.world_size, name)  # noqa: E731
    elif name == "side_stream":  # the token-split graph's start / wait pair

        def call():
            ops, args = torch.ops.tpweave, (ctx.group_name, ctx.world_size)
            y, h = ops.all_reduce_rms_norm_start(x, x, w, 1e-5, False, *args, 8)
            ops.all_reduce_rms_norm_wait(y, h, x, x, w, *args)
    else:
        call = functools.partial(
            torch.ops.tpweave.ag_mm, x, [x.t()], [None], [64 * ctx.world_size], ctx.group_name, ctx.world_size, name
        )
    call()
    torch.cuda.synchronize()
    dist.barrier()
    if ctx.rank != 0:
        # gone from the protocol, alive until rank 0 is done (its memory stays mapped, as torch's
        # symmetric memory stays when a process dies)
        time.sleep(2 * symm_buffers.wait_timeout_ms(ctx.group_name) / 1000)
        return None
    stdout_fd = os.dup(1)
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)  # the device's printf writes to the process's fd 1
        start = time.monotonic()
        try:
            call()
            torch.cuda.synchronize()
            error = None
        except RuntimeError as e:
            error = str(e)
        elapsed = time.monotonic() - start
        os.dup2(stdout_fd, 1)
    return elapsed, error, open(log_path).read()


@torch.no_grad()
def gpu_overlap_replays(ctx, name, token_counts, k, n, num_replays=6):
    """Every op strategy `name` implements (ag_mm, mm_rs, mm_rs_rms_norm, FP8 ag_scaled_mm and
    scaled_mm_rs), eager back to back and as CUDA-graph replays on new data, against a reference every
    rank computes alone in fp32 (each rank draws every rank's inputs from seeds). Returns
    {"ops": [...], (M, "eager", step) | (M, "graph"): {output: worst error relative to the reference's
    largest value}}."""
    from tpweave.ops import fp8
    from tpweave.ops.strategies import STRATEGIES

    strategy, tp, rank, dev = STRATEGIES[name], ctx.world_size, ctx.rank, ctx.device
    ops = [
        op
        for op in ("ag_mm", "mm_rs", "mm_rs_rms_norm", "ag_scaled_mm", "scaled_mm_rs")
        if getattr(strategy, op) is not None
    ]
    if "ag_scaled_mm" in ops and not fp8.has_scaled_mm("cuda"):
        ops = [op for op in ops if op not in ("ag_scaled_mm", "scaled_mm_rs")]
    w = _draw(7, n, k, device=dev).t() * k**-0.5  # (k, n)
    w2 = _draw(8, k, n, device=dev).t() * n**-0.5  # (n, k)
    bias = _draw(9, n // 2, device=dev)
    norm_w = torch.rand(k, device=dev, generator=torch.Generator(device=dev).manual_seed(10)).to(torch.bfloat16) + 0.5
    wq, ws = fp8.quantize_weight(w.t(), per_channel=True)
    w2q, w2s = fp8.quantize_weight(w2.t(), per_channel=True)
    dequant = lambda q, s: q.float() * s.reshape(q.shape[0], 1)  # noqa: E731

    def inputs(m, seed):
        """This rank's inputs, and every rank's shards / partial products' inputs for the reference."""
        rows = collectives.shard_rows(m, tp)
        shards = [_draw(seed * 97 + r, rows, k, device=dev) for r in range(tp)]
        partials = [_draw(seed * 97 + 100 + r, m, n, device=dev) for r in range(tp)]
        mine = {"x": shards[rank], "a": partials[rank], "res": _draw(seed * 97 + 200 + rank, rows, k, device=dev)}
        mine["xq"], mine["xs"] = fp8.quantize_rows(mine["x"])
        mine["aq"], mine["as"] = fp8.quantize_rows(mine["a"])
        return mine, shards, partials

    def reference(m, mine, shards, partials):
        rows, want = collectives.shard_rows(m, tp), {}
        mine_rows = slice(rank * rows, (rank + 1) * rows)
        full = torch.cat(shards)[:m].float()
        if "ag_mm" in ops:
            want.update(gathered=full, out=full @ w.float(), out_bias=full @ w[:, : n // 2].float() + bias.float())
        summed = sum(p.float() @ w2.float() for p in partials)[mine_rows]
        if "mm_rs" in ops:
            want["rs"] = summed
        if "mm_rs_rms_norm" in ops:
            h = summed + mine["res"][: len(summed)].float()
            want["norm_y"] = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.float()
            want["norm_h"] = h
        if "ag_scaled_mm" in ops:
            quantized = [fp8.quantize_rows(s) for s in shards]
            full_q, full_s = torch.cat([q for q, _ in quantized])[:m], torch.cat([s for _, s in quantized])[:m]
            want.update(
                fp8_gathered=full_q.float(), fp8_scale=full_s, fp8_out=dequant(full_q, full_s) @ dequant(wq, ws).t()
            )
        if "scaled_mm_rs" in ops:
            want["fp8_rs"] = sum(dequant(*fp8.quantize_rows(p)) @ dequant(w2q, w2s).t() for p in partials)[mine_rows]
        return want

    def run(mine):  # m: the loop's current token count
        got, g = {}, ctx.group_name
        if "ag_mm" in ops:
            got["gathered"], got["out"], got["out_bias"] = torch.ops.tpweave.ag_mm(
                mine["x"], [w, w[:, : n // 2]], [None, bias], [m], g, tp, name
            )
        if "mm_rs" in ops:
            got["rs"] = torch.ops.tpweave.mm_rs(mine["a"], w2, g, tp, name)
        if "mm_rs_rms_norm" in ops:
            got["norm_y"], got["norm_h"] = torch.ops.tpweave.mm_rs_rms_norm(
                mine["a"], w2, mine["res"], norm_w, 1e-5, False, g, tp, name
            )
        if "ag_scaled_mm" in ops:
            got["fp8_gathered"], got["fp8_scale"], got["fp8_out"] = torch.ops.tpweave.ag_scaled_mm(
                mine["xq"], mine["xs"], [wq], [ws], [None], [m], g, tp, torch.bfloat16, name
            )
        if "scaled_mm_rs" in ops:
            got["fp8_rs"] = torch.ops.tpweave.scaled_mm_rs(
                mine["aq"], mine["as"], w2q, w2s, g, tp, torch.bfloat16, name
            )
        return got

    def worst(got, want):
        return {
            key: float((got[key].float()[: len(r)] - r).abs().max() / max(1.0, float(r.abs().max())))
            if r.numel()
            else 0.0
            for key, r in want.items()
        }

    out = {"ops": ops, "available": strategy.available(w)}
    for m in token_counts:
        for step in range(3):  # back to back: a rank may start the next op while its peer still reads
            mine, shards, partials = inputs(m, step)
            out[(m, "eager", step)] = worst(run(mine), reference(m, mine, shards, partials))
        static, _, _ = inputs(m, 50)
        run(static)
        graph, got = capture_graph(lambda: run(static))
        errs = []
        for step in range(num_replays):
            mine, shards, partials = inputs(m, 60 + step)
            for key, t in static.items():
                t.copy_(mine[key])
            graph.replay()
            errs.append(worst(got, reference(m, mine, shards, partials)))
        out[(m, "graph")] = {key: max(e[key] for e in errs) for key in errs[0]}
        del graph
    return out


@torch.no_grad()
def dtensor_model_outputs(ctx, shapes, compile_kwargs):
    """A model sharded by torch's parallelize_module (DTensor): eager and tpweave-compiled outputs, report."""
    import tpweave
    from foreign_models import VOCAB, DTensorModel

    model = DTensorModel()
    if ctx.world_size > 1:
        model.parallelize(ctx.world_size)
    inputs = [torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(sum(shape))) for shape in shapes]
    eager = [model(ids) for ids in inputs]
    if ctx.world_size == 1:
        return {"eager": eager}
    compiled = compile_strict(model, **compile_kwargs)
    rep = tpweave.report(compiled)
    # every other call by keyword: M comes from keyword arguments too
    outs = [compiled(ids) if i % 2 else compiled(ids_BS=ids) for i, ids in enumerate(inputs)]
    return {
        "eager": eager,
        "compiled": outs,
        "num_compiles": rep.num_compiles,
        "graphs": [(g.variant, g.counts_before, g.counts_after) for g in rep.graphs],
    }


def _compiled_hf_logits(model, inputs, want, compile_kwargs=None) -> dict:
    """The HF model compiled by tpweave (default: SP forced), called by keyword: logits against `want`, the report."""
    import tpweave

    compiled = compile_strict(model, **(compile_kwargs or {"sp_min_tokens": 0}))
    got = [compiled(input_ids=ids).logits for ids in inputs]
    rep = tpweave.report(compiled)
    return {
        "want": want,
        "got": got,
        "graphs": [(g.variant, g.counts_before, g.counts_after) for g in rep.graphs],
        "sites": [[(s.kind, s.action, s.reason) for s in g.sites] for g in rep.graphs],
        "schedules": [list(g.schedule) for g in rep.graphs],
        "notes": list(rep.notes) + [n for g in rep.graphs for n in g.notes],
        "report": str(rep),
    }


@torch.no_grad()
def hf_model_outputs(ctx, arch, shapes, compile_kwargs=None):
    """A Hugging Face transformers model (tiny config, random weights) sharded with torch's
    parallelize_module and the usual TP plan, called like HF models are (keyword arguments): logits of
    the unsharded model, of the tpweave-compiled TP model (default: SP forced), and the compile report."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    }[arch]
    config = config_cls(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        attn_implementation="sdpa" if arch == "llama" else "eager",
    )  # Gemma-2's soft-capping: no SDPA
    torch.manual_seed(0)
    model = model_cls(config).eval()
    inputs = [torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(sum(shape))) for shape in shapes]
    want = [model(input_ids=ids).logits for ids in inputs]
    plan = {f"self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
    plan |= {
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    return _compiled_hf_logits(model, inputs, want, compile_kwargs)


@torch.no_grad()
def tp_subgroup_outputs(ctx, token_counts, tp):
    """World = (world / tp) groups of `tp` consecutive ranks (data parallel x TP): the tiny Llama on this
    rank's TP group, compiled with that group; [(compiled, eager) logits per M] and the report."""
    import torch.distributed as dist

    import tpweave
    from tpweave.runtime.context import TPContext

    groups = [
        dist.new_group(list(range(start, start + tp))) for start in range(0, ctx.world_size, tp)
    ]  # every rank creates every group
    group = groups[ctx.rank // tp]
    model = build_model("tiny", tp=TPContext.from_group(group, device=ctx.device), dtype=torch.float32, seed=0)
    compiled = compile_strict(model, group=group, sp_min_tokens=0)
    outs = []
    for m in token_counts:
        batch = batch_for(m, vocab_size=model.config.vocab_size, device=ctx.device)
        outs.append((compiled(*batch.args()), model(*batch.args())))
    return outs, tpweave.report(compiled).graphs[0].counts_after


@torch.no_grad()
def gather_read_before_its_matmul(ctx):
    """A post-grad-like graph where an op reads the gathered tokens before the matmul that also reads
    them: fuse_all_gather_matmuls must keep the graph in order. (original, fused) outputs and op order."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tpweave.compiler.async_tp import fuse_all_gather_matmuls
    from tpweave.compiler.graph_utils import GraphEditor, aten, tpw
    from tpweave.compiler.report import GraphReport

    world, group_name = ctx.world_size, torch.distributed.group.WORLD.group_name
    x_local, w = torch.randn(5, 8, generator=torch.Generator().manual_seed(ctx.rank)), torch.randn(8, 6)
    graph = fx.Graph()
    fake = FakeTensorMode()
    a, b = graph.placeholder("x_local"), graph.placeholder("w")
    a.meta["val"], b.meta["val"] = fake.from_tensor(x_local), fake.from_tensor(w)
    out = graph.output(())
    edit = GraphEditor(graph)
    ag = edit.insert(tpw.all_gather_tokens.default, (a, [5 * world], group_name, world), before=out)
    shifted = edit.insert(aten.roll.default, (ag, [1], [0]), before=out)  # reads every token, before the mm
    mm = edit.insert(aten.mm.default, (ag, b), before=out)
    out.args = ((shifted, mm),)
    before = fx.GraphModule(torch.nn.Module(), graph)(x_local, w)
    fuse_all_gather_matmuls(graph, policy_for=lambda *_: "sequential", report=GraphReport("sp"))
    graph.lint()
    after = fx.GraphModule(torch.nn.Module(), graph)(x_local, w)
    return before, after, [str(n.target) for n in graph.nodes if n.op == "call_function"]


@torch.no_grad()
def hf_tp_plan_outputs(ctx, arch, shapes, path):
    """A Hugging Face model as its users run TP: a tiny random checkpoint saved with save_pretrained
    (safetensors), loaded on every rank with transformers' own tensor parallelism (tp_plan="auto"),
    compiled by tpweave (SP forced). Logits of the unsharded model and the compiled TP one, and the report."""
    import torch.distributed as dist
    import transformers

    if ctx.rank == 0:
        config = transformers.AutoConfig.for_model(
            arch,
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            pad_token_id=0,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    dist.barrier()
    inputs = [torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(sum(shape))) for shape in shapes]
    unsharded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = [unsharded(input_ids=ids).logits for ids in inputs]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=transformers.DistributedConfig(tp_plan="auto")
    ).eval()
    return _compiled_hf_logits(model, inputs, want)


def _save_hf_llama(path, **dims):
    """A random 2-layer transformers Llama of these dimensions (seed 0, pad token 0) saved at path."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=2, pad_token_id=0, **dims)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


@torch.no_grad()
def hf_generate_with_compiled_forward(ctx, path, prompts, max_new_tokens):
    """HF `generate` (prefill + decode with HF's KV cache) of a tiny Llama loaded with tp_plan="auto", its
    forward replaced by tpweave.compile(model.forward): greedy tokens of the unsharded and of the
    compiled TP model, and the compile report's graphs."""
    import torch.distributed as dist
    import transformers

    import tpweave

    if ctx.rank == 0:
        _save_hf_llama(path, vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=256)  # fmt: skip
    dist.barrier()
    unsharded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, distributed_config=transformers.DistributedConfig(tp_plan="auto")
    ).eval()
    model.forward = tpweave.compile(model.forward, sp_min_tokens=0, strict=True)
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": 0}
        want = unsharded.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)[0].tolist()
        got = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)[0].tolist()
        out.append((got, want))
    report = tpweave.report(model.forward)
    graphs = [(g.variant, g.counts_before, g.counts_after) for g in report.graphs]
    return {"tokens": out, "graphs": graphs, "notes": list(report.notes), "report": str(report)}


def bench_layers_record(ctx, tokens):
    """bench_layers of the tiny model (1 layer, 2 repetitions): (rows, record)."""
    from tpweave.bench.layer import BenchSettings, bench_layers

    settings = BenchSettings(reps=2, warmup=1, inner=1)
    return bench_layers(ctx, "tiny", tokens, dtype_name="float32", num_layers=1, settings=settings, table=None)


# Strategy configurations of the graph-mode test: compile options that route every collective of LayerHead
# through tpweave's own symmetric-memory kernels (the ones emulated ranks can run: tests/emulated_ranks.py).
GRAPH_MODE_CONFIGS = {
    "triton_ar_norm": dict(sp=False, all_reduce_rms_norm_policy="triton_ar_norm"),
    "triton_ar_norm_ll": dict(sp=False, all_reduce_rms_norm_policy="triton_ar_norm_ll"),
    "ce_overlap": dict(sp=True, sp_min_tokens=0, ag_mm_policy="ce_overlap", mm_rs_policy="ce_overlap"),
    "ce_overlap_2s": dict(sp=True, sp_min_tokens=0, ag_mm_policy="ce_overlap_2s", mm_rs_policy="ce_overlap"),
    # the plain graph as two token subsets from M = 4 on, each subset's all-reduce + norm on a side stream
    "token_split": dict(
        sp=False, token_split_min_tokens=4, token_split_sms=8, all_reduce_rms_norm_policy="triton_ar_norm"
    ),
}
GRAPH_MODES = {"capture": {}, "trees": dict(cudagraphs=True), "partition": dict(cudagraphs=True, piecewise=True)}


class LayerHead(torch.nn.Module):
    """One decoder layer, the final norm and a column-parallel head: each all-reduce of its TP graph follows a
    row-parallel matmul and precedes a residual add + RMSNorm (no embedding all-reduce, no gathered logits), so
    one strategy can serve every collective site. forward(x (M, H) replicated, positions, cu_seqlens) -> this
    rank's head columns (M, 1024 / TP)."""

    def __init__(self, ctx, dtype=torch.bfloat16):
        import dataclasses

        from tpweave.models.config import get_preset
        from tpweave.models.layers import ColumnParallelLinear, RMSNorm, RotaryEmbedding
        from tpweave.models.llama import DecoderLayer

        super().__init__()
        cfg = dataclasses.replace(
            get_preset("llama3-8b"), hidden_size=2048, num_heads=16, num_kv_heads=4, intermediate_size=4096
        )
        rotary = RotaryEmbedding(
            cfg.head_dim, theta=cfg.rope_theta, scaling=None, max_positions=4096, device=ctx.device
        )
        self.layer = DecoderLayer(cfg, tp=ctx, dtype=dtype, rotary=rotary)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, device=ctx.device)
        self.head = ColumnParallelLinear(cfg.hidden_size, 1024, tp=ctx, bias=False, dtype=dtype)
        sharded, replicated = torch.Generator().manual_seed(1234 + ctx.rank), torch.Generator().manual_seed(99)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:  # this rank's shard
                    p.copy_(torch.randn(p.shape, generator=sharded) * 0.02)
                else:  # norm weights: the same on every rank, as in any TP model
                    p.copy_(torch.rand(p.shape, generator=replicated) + 0.5)

    def forward(self, x, positions, cu_seqlens):
        return self.head(self.norm(self.layer(x, positions, cu_seqlens)))


@torch.no_grad()
def gpu_graph_modes(ctx, config, token_counts, replays):
    """LayerHead compiled under strategy configuration `config` (GRAPH_MODE_CONFIGS) in each graph mode: tpweave
    compiled and captured in a CUDA graph per M ("capture", as the engine does), Inductor's CUDA graph trees
    ("trees") and graph partition at attention with trees per piece ("partition"). Each M is warmed up (and
    captured), then replayed `replays` times on new data against the eager module run on the CPU (gloo).
    Returns {(mode, M): worst |out - ref| / max |ref|}, {(mode, "counts"): (compiles, captures) after the
    warm-up and at the end}, {(mode, "dispatched"): policies in the compiled graphs}."""
    import copy

    from torch._inductor import cudagraph_trees

    import tpweave

    torch.manual_seed(0)
    module = LayerHead(ctx)
    reference = copy.deepcopy(module).to("cpu")
    hidden = module.norm.weight.shape[0]
    recorded = [0]
    original_init = cudagraph_trees.CUDAGraphNode.__init__

    def counting_init(self, *args, **kwargs):
        recorded[0] += 1
        original_init(self, *args, **kwargs)

    cudagraph_trees.CUDAGraphNode.__init__ = counting_init

    def data(m, step):
        gen = torch.Generator().manual_seed(m * 1000 + step)  # the same on every rank: x is replicated
        lens = split_tokens(m, 3)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        pos = torch.cat([torch.arange(n) for n in lens])
        return torch.randn(m, hidden, generator=gen).to(torch.bfloat16), pos, cu

    def error(out, args_cpu):
        want = reference(*args_cpu).float()
        return float((out.float().cpu() - want).abs().max() / want.abs().max())

    results = {}
    for mode, graph_options in GRAPH_MODES.items():
        torch._dynamo.reset()
        compiled = tpweave.compile(module, strict=True, **GRAPH_MODE_CONFIGS[config], **graph_options)
        captured = {}  # M -> (graph, static inputs, static output)
        pool = torch.cuda.graph_pool_handle()
        before = recorded[0]
        for step in range(1 + replays):
            for m in sorted(token_counts, reverse=True):  # largest first: buffers sized before any capture
                args_cpu = data(m, step)
                args = [t.to(ctx.device) for t in args_cpu]
                if mode == "capture":
                    if m not in captured:
                        for _ in range(2):
                            compiled(*args)
                        torch.cuda.synchronize()
                        ctx.group and torch.distributed.barrier(group=ctx.group)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool):
                            static_out = compiled(*args)
                        captured[m] = (graph, args, static_out)
                    graph, static_args, static_out = captured[m]
                    for dst, src in zip(static_args, args):
                        dst.copy_(src)
                    graph.replay()
                    out = static_out.clone()
                else:
                    calls = 3 if step == 0 else 1  # trees: warm-up, record, replay
                    for _ in range(calls):
                        torch.compiler.cudagraph_mark_step_begin()
                        out = compiled(*args).clone()
                if step > 0:
                    results[(mode, m)] = max(results.get((mode, m), 0.0), error(out, args_cpu))
            if step == 0:
                warm = (tpweave.report(compiled).num_compiles, recorded[0] - before + len(captured))
        end = (tpweave.report(compiled).num_compiles, recorded[0] - before + len(captured))
        results[(mode, "counts")] = (warm, end)
        results[(mode, "dispatched")] = sorted({p for g in tpweave.report(compiled).graphs for _, p in g.dispatched})
        results[(mode, "schedule")] = max((len(g.schedule) for g in tpweave.report(compiled).graphs), default=0)
        del captured
    cudagraph_trees.CUDAGraphNode.__init__ = original_init
    return results


def _step_chunks(engine, step, rng):
    """The chunks of a step given as (prompt length, start, new tokens) each, on random token ids, their KV blocks
    taken from the engine's block manager (free them after)."""
    from tpweave.engine.scheduler import ScheduledChunk
    from tpweave.engine.sequence import Sequence

    chunks = []
    for length, start, num_new in step:
        seq = Sequence([rng.randrange(engine.vocab_size) for _ in range(length)])
        engine.scheduler.blocks.grow(seq, start + num_new)
        chunks.append(ScheduledChunk(seq, start, num_new, samples=True))
    return chunks


@torch.no_grad()
def gpu_piecewise_steps(ctx, model, engine_kwargs, steps, replays):
    """The engine's prefill and mixed steps (`steps`: lists of (prompt length, start, new tokens) chunks) through
    its piecewise CUDA graphs against the same compiled forward run eagerly on the same padded inputs, `replays`
    times on new token ids each. Returns {step index: number of replays whose logits were bitwise equal}, and
    the graph counts after the first and the last round."""
    import random

    from tpweave.engine import LLMEngine
    from tpweave.engine.buckets import bucket_for

    engine = LLMEngine(ctx, model, **engine_kwargs)
    runner, rng = engine.runner, random.Random(0)
    assert runner.pieces is not None
    equal, counts, diffs = {}, [], []

    def forward_compiles():
        report = getattr(runner.forward, "compile_report", None)
        return report.num_compiles if report is not None else 0

    for rnd in range(replays):
        for i, step in enumerate(steps):
            chunks = _step_chunks(engine, step, rng)
            num_tokens = sum(c.num_tokens for c in chunks)
            args = runner._inputs(chunks, pad_to=bucket_for(runner.prefill_buckets, num_tokens), rows_to=len(chunks))
            eager = runner.forward(*args).clone()
            with runner.pieces.replaying():
                graphed = runner.forward(*args).clone()
            if not torch.equal(eager, runner.forward(*args)):  # the eager forward against itself
                diffs.append((i, rnd, "eager twice differ"))
            equal[i] = equal.get(i, 0) + int(torch.equal(eager, graphed))
            if not torch.equal(eager, graphed):  # which round, by how much, with how many graphs compiled by then
                diffs.append((i, rnd, float((eager.float() - graphed.float()).abs().max()), forward_compiles()))
            for c in chunks:
                engine.scheduler.blocks.free(c.seq)
        counts.append(dict(runner.pieces.stats()))
    print("mismatches (step, round, max |diff|, graphs compiled):", diffs)
    return equal, counts[0], counts[-1], dict(runner.capture_stats)


def gpu_whole_step_steps(ctx, model, engine_kwargs, steps, replays):
    """gpu_piecewise_steps for the engine's CUDA graphs of whole prefill and mixed steps: each step's logits from
    its graph (runner.whole_step) against the compiled forward run eagerly on the same padded inputs, `replays`
    times on new token ids. Returns {step index: replays whose logits were bitwise equal}, {step index: the graph
    key (token bucket, sequence bucket, fresh) it replayed}, the graphs captured at start-up, the compiles during
    the replays (the eager comparisons may compile their own), and (the memory all captures took, the bytes of
    the whole-step graphs' logits)."""
    import random

    from tpweave.engine import LLMEngine
    from tpweave.engine.buckets import bucket_for

    engine = LLMEngine(ctx, model, **engine_kwargs)
    runner, rng = engine.runner, random.Random(0)
    report = runner.forward.compile_report
    replay_compiles, captured = 0, len(runner.step_graphs)
    equal, keys, dev = {}, {}, ctx.device
    for _ in range(replays):
        for i, step in enumerate(steps):
            chunks = _step_chunks(engine, step, rng)
            bucket, run = runner.whole_step(chunks)
            before = report.num_compiles
            graphed = run().clone()
            replay_compiles += report.num_compiles - before
            num_tokens = sum(c.num_tokens for c in chunks)
            seq_bucket = bucket_for(runner._seq_buckets, len(chunks) + (bucket > num_tokens))
            *arrays, _, fresh = runner._host_inputs(chunks, pad_to=bucket, rows_to=seq_bucket,
                                                    seqs_to=runner._step_seqs(bucket, seq_bucket),
                                                    width_to=runner._step_width)  # fmt: skip
            ids, pos, cu, slots, ctx_lens, tables, rows = (torch.from_numpy(a).to(dev) for a in arrays)
            eager = runner.forward(ids, pos, cu, slots, ctx_lens, tables, runner.block_size, rows, torch.tensor(fresh))
            equal[i] = equal.get(i, 0) + int(torch.equal(eager[: len(chunks)], graphed))
            keys[i] = (bucket, seq_bucket, fresh)
            for c in chunks:
                engine.scheduler.blocks.free(c.seq)
    # the graphs' logits, were each kept: the memory the captures took stays below it (they are not kept)
    logits_bytes = sum(t.numel() * t.element_size() for t in runner._step_out.values())
    return equal, keys, captured, replay_compiles, (runner.capture_stats["graph_memory_bytes"], logits_bytes)


def gpu_piecewise_generate(ctx, model, prompts, max_tokens, engine_kwargs):
    """gpu_engine_generate twice in one engine: tokens, the runner's step counts and the piecewise graphs' stats
    after each round."""
    from tpweave.engine import LLMEngine, SamplingParams

    engine = LLMEngine(ctx, model, **engine_kwargs)
    rounds = []
    for _ in range(2):
        results = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
        pieces = engine.runner.pieces
        rounds.append((results, dict(engine.runner.step_stats), pieces.stats() if pieces is not None else None))
    return rounds


@torch.no_grad()
def graph_mode_structure(ctx, token_counts):
    """LayerHead (float32 on the CPU) compiled with torch's symm_mem strategies on every site (the SP graph's
    all-gather + matmul and matmul + reduce-scatter from M >= 64 on, the plain graph's all-reduce + norm below,
    one-shot then two-shot) under Inductor's CUDA graph trees and graph partition: {M: worst |compiled - eager| /
    max |eager|}, and the policies the compiled graphs dispatch."""
    import tpweave

    module = LayerHead(ctx, dtype=torch.float32)
    compiled = tpweave.compile(
        module, strict=True, sp=True, sp_min_tokens=64, ag_mm_policy="symm_mem_fused", mm_rs_policy="symm_mem_fused",
        all_reduce_rms_norm_policy="symm_mem_one_shot@0,symm_mem_two_shot@16", cudagraphs=True, piecewise=True,
    )  # fmt: skip
    out, hidden = {}, module.norm.weight.shape[0]
    for m in token_counts:
        gen = torch.Generator().manual_seed(m)
        lens = split_tokens(m, 3)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        args = (torch.randn(m, hidden, generator=gen), torch.cat([torch.arange(n) for n in lens]), cu)
        want = module(*args)
        out[m] = float((compiled(*args) - want).abs().max() / want.abs().max())
    out["dispatched"] = sorted({p for g in tpweave.report(compiled).graphs for _, p in g.dispatched})
    return out


def invariant_logits(ctx, sp_min_tokens, token_split_min_tokens=None):
    """Our Llama (wide enough that torch's fp32 matmul is batch-dependent) compiled with invariant="batch": for
    sequences of 1, 3, 6 and 37 tokens, whether the logits alone equal those packed with others (M up to 420; the
    SP graph from sp_min_tokens on, the token-split graph from token_split_min_tokens below it), the largest
    difference, how many calls each graph variant served, and each variant's graphs' collectives and schedules."""
    import torch

    from tpweave import compiler
    from tpweave.compiler import CompileOptions
    from tpweave.models import build_model
    from tpweave.models.inputs import pack

    torch._dynamo.reset()
    wide = dict(hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=4, head_dim=64)
    model = build_model("tiny", tp=ctx, dtype=torch.float32, **wide)
    options = CompileOptions(invariant="batch", strict=True, sp_min_tokens=sp_min_tokens,
                             token_split_min_tokens=token_split_min_tokens)  # fmt: skip
    compiled = compiler.compile(model, options=options)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    others = [torch.randint(0, vocab, (n,), generator=g) for n in (5, 100, 250, 3, 64)]

    equal, worst = [], 0.0
    with torch.no_grad():
        for length in (1, 3, 6, 37):
            target = torch.randint(0, vocab, (length,), generator=g)
            alone = compiled(*pack([target]).args())
            for layout in ([0, 1], [2, 0, 3], [4, 3, 0, 5]):
                seqs = [target if i == 0 else others[i - 1] for i in layout]
                start = sum(len(s) for s in seqs[: layout.index(0)])
                got = compiled(*pack(seqs).args())[start : start + length]
                equal.append(torch.equal(got, alone))
                worst = max(worst, (got - alone).abs().max().item())
    collectives, schedules = {}, {}
    for graph in compiler.report(compiled).graphs:
        collectives.setdefault(graph.variant, []).append(dict(graph.counts_after))
        schedules.setdefault(graph.variant, []).append(list(graph.schedule))
    return equal, worst, dict(compiled.calls), collectives, schedules


@torch.no_grad()
def hf_invariant_logits(ctx, path, level="batch"):
    """A Hugging Face Llama (wide enough that fp32 matmuls are batch-dependent) loaded with transformers' own TP plan
    (tp_plan="auto"; at one rank without), its forward compiled with invariant=level and strict=True: whether a
    prompt's logits alone equal its rows in right-padded batches of 2 and 3 (M up to 300, the SP graph from 64 on),
    the report's swaps, the calls per graph variant, and the prompts' logits alone."""
    import torch.distributed as dist
    import transformers

    import tpweave
    from tpweave.compiler import CompileOptions

    torch._dynamo.reset()
    if ctx.rank == 0:
        _save_hf_llama(path, vocab_size=256, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=64, max_position_embeddings=512)  # fmt: skip
    if ctx.world_size > 1:
        dist.barrier()
        extra = {"distributed_config": transformers.DistributedConfig(tp_plan="auto")}
    else:
        extra = {}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()
    forward = tpweave.compile(model.forward, options=CompileOptions(invariant=level, strict=True, sp_min_tokens=64))
    g = torch.Generator().manual_seed(1)
    equal, alones = [], []
    for length in (1, 6, 37):
        target = torch.randint(1, 256, (length,), generator=g)
        alone = forward(input_ids=target[None], attention_mask=torch.ones(1, length, dtype=torch.long)).logits[0]
        alones.append(alone)
        for others in ([40], [100, 3]):
            seqs = [torch.randint(1, 256, (n,), generator=g) for n in others] + [target]
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, s in enumerate(seqs):
                ids[i, : len(s)], mask[i, : len(s)] = s, 1
            got = forward(input_ids=ids, attention_mask=mask).logits[-1, :length]
            equal.append(torch.equal(got, alone))
    report = tpweave.report(forward)
    return equal, [gr.invariant for gr in report.graphs], dict(forward.calls), alones


def tp_invariant_logits(ctx, level, dtype=None):
    """Our Llama (wide) compiled with invariant=level, the token-split graph from M = 16 (at TP >= 2), the SP graph
    from M = 64, on ctx's device in `dtype` (default fp32): [(what, logits on the CPU)] for a sequence of 37 tokens
    alone, packed with sequences of 10 and 5, and packed with sequences of 100, 250 and 33; and how many calls each
    graph variant served, and its graphs' collectives and schedules."""
    import torch

    from tpweave import compiler
    from tpweave.compiler import CompileOptions
    from tpweave.models import build_model
    from tpweave.models.inputs import pack

    torch._dynamo.reset()
    wide = dict(hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=4, head_dim=64)
    model = build_model("tiny", tp=ctx, dtype=dtype or torch.float32, **wide)
    options = CompileOptions(invariant=level, strict=True, sp_min_tokens=64, token_split_min_tokens=16)
    compiled = compiler.compile(model, options=options)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (37, 100, 250, 33, 10, 5)]
    with torch.no_grad():
        cases = (("alone", [0]), ("packed 52", [0, 4, 5]), ("packed 420", [0, 1, 2, 3]))
        logits = [(what, compiled(*pack([seqs[i] for i in which], device=ctx.device).args()).cpu())
                  for what, which in cases]  # fmt: skip
    collectives, schedules = {}, {}
    for graph in compiler.report(compiled).graphs:
        collectives.setdefault(graph.variant, []).append(dict(graph.counts_after))
        schedules.setdefault(graph.variant, []).append(list(graph.schedule))
    return logits, dict(compiled.calls), collectives, schedules


def ordered_strategy_outputs(ctx, counts):
    """The ordered strategies' async-TP ops (ops/strategies/ordered.py) on this rank against the unfused ops they
    stand for, at each M of counts: {(strategy, kind, M): bitwise equal}, and for each strategy and kind the order
    in which one call issued its collective, multiplied and waited ("start", "mm", "wait")."""
    import torch

    from tpweave.ops import invariant
    from tpweave.ops.collectives import ordered_reduce_scatter_tokens, shard_rows
    from tpweave.ops.strategies import ordered

    group, world = ctx.comm_group_name, ctx.world_size
    g = torch.Generator().manual_seed(10 + ctx.rank)
    k, n = 128, 96
    w, b = torch.randn(k, n, generator=g), torch.randn(n, generator=g)
    equal = {}
    for m in counts:
        x_local = torch.randn(shard_rows(m, world), k, generator=g)
        a = torch.randn(m, k, generator=g)
        full = torch.ops.tpweave.all_gather_tokens(x_local, [m], group, world)
        tree = invariant.tp_invariant_mm(full, w), invariant.tp_invariant_addmm(b, full, w)
        wants = {
            ("ordered", "ag_mm"): [full, invariant.invariant_mm(full, w), invariant.invariant_addmm(b, full, w)],
            ("ordered_tp", "ag_mm"): [full, *tree],
            ("ordered", "mm_rs"): [ordered_reduce_scatter_tokens(invariant.invariant_mm(a, w), 1, group, world)],
            ("ordered_tp", "mm_rs"): [invariant.tp_invariant_mm_reduce_scatter(a, w, group, world)],
        }
        for (name, kind), want in wants.items():
            strategy = getattr(ordered, "ORDERED_TP" if name == "ordered_tp" else "ORDERED")
            if kind == "ag_mm":
                got = strategy.ag_mm(x_local, [w, w], [None, b], [m], group, world)
            else:
                got = [strategy.mm_rs(a, w, group, world)]
            equal[(name, kind, m)] = len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want))

    events = []

    class Recording:
        def __getattr__(self, op):
            def call(*args):
                events.append("wait" if op == "wait_tensor" else "start")
                return getattr(torch.ops._c10d_functional, op)(*args)

            return call

    product = ordered._product
    ordered._funcol = Recording()
    ordered._product = lambda *args: (events.append("mm"), product(*args))[1]
    orders = {}
    m = 64
    for name in ("ORDERED", "ORDERED_TP"):
        strategy = getattr(ordered, name)
        events.clear()
        strategy.ag_mm(torch.randn(shard_rows(m, world), k, generator=g), [w], [None], [m], group, world)
        orders[(name, "ag_mm")] = list(events)
        events.clear()
        strategy.mm_rs(torch.randn(m, k, generator=g), w, group, world)
        orders[(name, "mm_rs")] = list(events)
    return equal, orders


def engine_logits(ctx, prompt_groups, config, *, pad_to=None, params=None, by_group=False):
    """Generation of each group of prompts in turn by one engine of the tiny Llama (greedy unless `params`): each
    group's results, the logits row of every sampled token keyed by the tokens it was computed from (by_group: a dict
    for each group), how the steps ran (runner.step_stats, with the most sequences a step held) and the calls each
    compiled graph variant served."""
    import torch

    from tpweave.compiler.piecewise import PiecewiseGraphs
    from tpweave.engine import LLMEngine, SamplingParams

    torch._dynamo.reset()
    engine = LLMEngine(ctx, "tiny", **config)
    runner = engine.runner
    if pad_to is not None and runner.pieces is None:  # the padding the piecewise CUDA graphs bring, on a CPU
        runner.pieces, runner.prefill_buckets = PiecewiseGraphs(), list(pad_to)
    seen: dict[tuple, torch.Tensor] = {}
    groups_seen: list[dict[tuple, torch.Tensor]] = []
    most_seqs = 0
    forward, launch, decode_with_graph, whole_step = (runner.forward, runner.launch, runner._decode_with_graph,
                                                      runner.whole_step)  # fmt: skip

    def recording_launch(chunks):
        nonlocal most_seqs
        most_seqs = max(most_seqs, len(chunks))
        step = {}

        def recording_forward(*args):
            step["logits"] = forward(*args)
            return step["logits"]

        def recording_decode(*args):  # a decode step replayed from its CUDA graph
            logits = decode_with_graph(*args)
            if logits is not None:
                step["logits"] = logits
            return logits

        def recording_whole_step(*args):  # a prefill or mixed step replayed from its graph of the whole step
            whole = whole_step(*args)
            if whole is None:
                return None

            def run():
                step["logits"] = whole[1]()
                return step["logits"]

            return whole[0], run

        runner.forward, runner._decode_with_graph, runner.whole_step = (recording_forward, recording_decode,
                                                                        recording_whole_step)  # fmt: skip
        try:
            out = launch(chunks)
        finally:
            runner.forward, runner._decode_with_graph, runner.whole_step = forward, decode_with_graph, whole_step
        for b, c in enumerate(chunks):
            if c.samples:
                seen[tuple(c.seq.tokens(0, c.start + c.num_tokens))] = step["logits"][b].clone()
        return out

    runner.launch = recording_launch
    results = []
    for prompts in prompt_groups:
        results.append(engine.generate(prompts, params or SamplingParams(max_tokens=6)))
        groups_seen.append(seen)
        seen = {} if by_group else seen
    calls = dict(getattr(forward, "calls", {}))  # the steps each compiled graph variant served
    stats = dict(runner.step_stats, most_seqs=most_seqs)
    return results, groups_seen if by_group else seen, stats, calls


@torch.no_grad()
def hf_invariant_cache_logits(ctx, path, level):
    """A Hugging Face Llama (wide; at TP >= 2 under transformers' own TP plan), its forward compiled with
    invariant=level and strict=True (the SP graph from M = 64): a 100-token prompt's logits from one prefill against
    the same rows through HF's KV cache: a prefill of 50 tokens, a chunk of 40 after it, then 10 decodes.
    [(which rows, bitwise equal, largest difference)]."""
    import torch.distributed as dist
    import transformers

    import tpweave
    from tpweave.compiler import CompileOptions

    torch._dynamo.reset()
    if ctx.rank == 0:
        _save_hf_llama(path, vocab_size=256, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=64, max_position_embeddings=512)  # fmt: skip
    extra = {}
    if ctx.world_size > 1:
        dist.barrier()
        extra = {"distributed_config": transformers.DistributedConfig(tp_plan="auto")}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()
    forward = tpweave.compile(model.forward, options=CompileOptions(invariant=level, strict=True, sp_min_tokens=64))
    ids = torch.randint(1, 256, (1, 100), generator=torch.Generator().manual_seed(3))
    whole = forward(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    out, cache = [], None
    for start, end in [(0, 50), (50, 90)] + [(p, p + 1) for p in range(90, 100)]:
        step = forward(input_ids=ids[:, start:end], attention_mask=torch.ones(1, end, dtype=torch.long),
                       past_key_values=cache, use_cache=True)  # fmt: skip
        cache = step.past_key_values
        got, want = step.logits[0], whole[start:end]
        out.append(((start, end), torch.equal(got, want), (got - want).abs().max().item()))
    return out
