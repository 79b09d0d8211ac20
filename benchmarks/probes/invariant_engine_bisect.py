"""Which engine path gives a request's logits other bits in invariant mode (GPU, tiny Llama of
tests/test_invariant.py's WIDE shapes, bf16): one 300-token prompt alone, chunked (256 + 44) or in one step, with CUDA
graphs or without, and first among 256 other requests; every sampled token's logits against the chunked run's.
    python benchmarks/probes/invariant_engine_bisect.py [kernels] [VARIANT...] > bisect.log  (the first variant, the
    chunked run, always runs: the others are compared with it); `... kv`: each layer's cached K/V after the prefill;
    `... calls`: every matmul's and attention's output inside the step, call by call"""

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import workers  # noqa: E402
from tpweave.runtime.context import TPContext  # noqa: E402

WIDE = dict(hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=4, head_dim=64)


def kernels() -> None:
    """The kernels at the engine's shapes: rows of the matmul at the products' (N, K) across M, and a 300-token
    sequence's attention packed (fresh), padded as the engine pads a step, and paged in chunks of 256 + 44."""
    from test_gpu_attention import _paged_case
    from tpweave.ops import invariant_kernels as ik

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 1536, device="cuda", generator=g, dtype=torch.bfloat16)
    for n, k in ((1024, 512), (512, 512), (3072, 512), (512, 1536), (1536, 512)):
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
        ref = ik.matmul(x[:300, :k], w.t())
        same = {m: torch.equal(ik.matmul(x[:m, :k], w.t())[:300], ref) for m in (320, 512, 1024, 2048, 8192)}
        tail = {m: torch.equal(ik.matmul(x[256 : 256 + m, :k], w.t())[:44], ref[256:]) for m in (44, 48, 64)}
        print(f"matmul N={n} K={k}: rows 0-299 at M {same}; rows 256-299 at M {tail}", flush=True)
    args = _paged_case([300], [300], heads=8, kv_heads=4, head_dim=64, num_blocks=64)
    q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, scale = args
    k_cache[slots], v_cache[slots] = k_new, v_new
    paged = dict(block_size=bs, scale=scale)
    whole = ik.attention(q, k_cache, v_cache, cu, context_lens=ctx, block_tables=tables, **paged)
    print(f"attention packed == paged: {torch.equal(ik.attention(q, k_new, v_new, cu, scale=scale), whole)}")
    spans = ((0, 256), (256, 300))
    chunks = [ik.attention(q[a:b], k_cache, v_cache, cu.new_tensor([0, b - a]), context_lens=ctx.new_tensor([b]),
                           block_tables=tables, **paged) for a, b in spans]  # fmt: skip
    print(f"attention paged in chunks 256 + 44 == whole: {torch.equal(torch.cat(chunks), whole)}", flush=True)
    # as a step padded to 320 rows is: the padding rows one more sequence in the pad block, empty sequences up to the
    # sequence bucket, block tables as wide as the widest bucket's
    pad_block = next(b for b in range(64) if b not in tables[0].tolist())
    q_pad = torch.cat([q, q[:20]])
    for seqs, width in ((2, 19), (2, 512), (9, 19), (9, 512)):
        t = torch.full((seqs, width), pad_block, dtype=torch.int32, device="cuda")
        t[0, :19] = tables[0]
        cu_pad = torch.tensor([0, 300] + [320] * (seqs - 1), dtype=torch.int32, device="cuda")
        ctx_pad = torch.tensor([300, 20] + [0] * (seqs - 2), dtype=torch.int32, device="cuda")
        for split in (None, False, True):
            out = ik.attention(q_pad, k_cache, v_cache, cu_pad, context_lens=ctx_pad, block_tables=t, split=split,
                               **paged)  # fmt: skip
            print(f"attention padded: {seqs} sequences, tables {width} wide, split {split}: "
                  f"{torch.equal(out[:300], whole)}", flush=True)  # fmt: skip


def kv_after_prefill(prompt: list[int], config: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's cached K and V of the prompt's positions right after its prefill's last step."""
    from tpweave.engine import LLMEngine, SamplingParams

    torch._dynamo.reset()
    engine = LLMEngine(TPContext.single("cuda"), "tiny", **config)
    runner, launch, kv = engine.runner, engine.runner.launch, []
    layers = [m for m in runner.model.modules() if getattr(m, "k_cache", None) is not None]

    def snapshot_launch(chunks):
        out = launch(chunks)
        for c in chunks:
            if not kv and c.start + c.num_tokens == len(prompt):
                torch.cuda.synchronize()
                pos = torch.arange(len(prompt))
                slots = torch.tensor(c.seq.block_table)[pos // runner.block_size] * runner.block_size
                slots = (slots + pos % runner.block_size).cuda()
                kv.extend((m.k_cache[slots].clone(), m.v_cache[slots].clone()) for m in layers)
        return out

    runner.launch = snapshot_launch
    engine.generate([prompt], SamplingParams(max_tokens=2))
    import tpweave

    report = tpweave.report(runner.forward)
    print(f"  compiles {report.num_compiles}, graphs {[(g.variant, g.serves) for g in report.graphs]}", flush=True)
    return kv


def compare_kv(probe: list[int], base: dict, one_step: dict) -> None:
    """Where the one-step runs' cached K/V differ from the chunked run's: layer, K or V, positions."""
    ref = kv_after_prefill(probe, base)
    runs = {"one_step": one_step, "one_step_piecewise": {**one_step, "whole_step_graphs": False},
            "one_step_no_graphs": {**one_step, "cuda_graphs": False}}  # fmt: skip
    for name, over in runs.items():
        got = kv_after_prefill(probe, {**base, **over})
        for layer, ((k0, v0), (k1, v1)) in enumerate(zip(ref, got)):
            for what, a, b in (("K", k0, k1), ("V", v0, v1)):
                bad = (a != b).flatten(1).any(1).nonzero().flatten().tolist()
                print(f"{name:20s} layer {layer} {what}: {len(bad)} positions differ"
                      f"{f' (first {bad[:3]}, last {bad[-1]})' if bad else ''}", flush=True)  # fmt: skip


def stashed_outputs(prompt: list[int], config: dict, stashes_per_forward: int = 12) -> list[tuple[str, torch.Tensor]]:
    """The output (the attention's rotated q too) of every invariant matmul and attention call of at least the
    prompt's rows, for the prompt's rows, in call order, from the step that prefills it whole: copied inside the
    step (so inside its CUDA graph, where it has one) into buffers made at the first such call (an eager warm-up).
    Every forward of that many rows stashes the same `stashes_per_forward` tensors in the same order (2 layers: 4
    matmuls, and an attention's q and output each), which is how a call inside a graph knows its slot."""
    from tpweave.engine import LLMEngine, SamplingParams
    from tpweave.ops import invariant_kernels

    n = len(prompt)
    slots: dict[int, tuple[str, torch.Tensor]] = {}
    count = [0]
    originals = {"matmul": invariant_kernels.matmul, "attention": invariant_kernels.attention}

    def stash(name: str, t: torch.Tensor) -> None:
        i = count[0] % stashes_per_forward
        count[0] += 1
        if i not in slots:
            slots[i] = (name, torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=t.device))
        slots[i][1].copy_(t[:n])

    def matmul(a, *args, **kwargs):
        out = originals["matmul"](a, *args, **kwargs)
        if a.shape[0] >= n:
            stash("matmul", out)
        return out

    def attention(q, *args, **kwargs):
        out = originals["attention"](q, *args, **kwargs)
        if q.shape[0] >= n:
            stash("attention q", q)
            stash("attention", out)
        return out

    invariant_kernels.matmul, invariant_kernels.attention = matmul, attention
    try:
        torch._dynamo.reset()
        engine = LLMEngine(TPContext.single("cuda"), "tiny", **config)
        engine.generate([prompt], SamplingParams(max_tokens=1))
        torch.cuda.synchronize()
    finally:
        invariant_kernels.matmul, invariant_kernels.attention = originals["matmul"], originals["attention"]
    return [(name, t.clone()) for _, (name, t) in sorted(slots.items())]


def compare_calls(probe: list[int], base: dict, one_step: dict) -> None:
    """Call by call, the prompt prefilled in one step from a whole-step graph against without graphs: the first
    call whose output differs, and in which rows (the cached K/V put the difference in the first layer)."""
    ref = stashed_outputs(probe, {**base, **one_step, "cuda_graphs": False})
    got = stashed_outputs(probe, {**base, **one_step})
    for i, ((name, a), (_, b)) in enumerate(zip(ref, got)):
        bad = (a != b).flatten(1).any(1).nonzero().flatten().tolist()
        big = f", largest difference {(a.float() - b.float()).abs().max():.3g}" if bad else ""
        print(f"call {i:2d} {name:15s}: {len(bad)} rows differ{f' {bad[:8]}' if bad else ''}{big}", flush=True)


def main() -> None:
    # variant names (default: all); "kernels": the kernel checks; "kv": compare_kv; "calls": compare_calls
    wanted = sys.argv[1:]
    if not wanted or "kernels" in wanted:
        kernels()
    rng = random.Random(3)
    probes = [[rng.randrange(1536) for _ in range(n)] for n in (1, 9, 40, 130, 300)]
    base = dict(dtype=torch.bfloat16, block_size=16, max_num_seqs=256, max_num_batched_tokens=256, max_model_len=320,
                num_blocks=2000, async_scheduling=False, invariant="batch", model_overrides=WIDE)  # fmt: skip
    one_step = {"max_num_batched_tokens": 8192, "whole_step_graphs": True}
    p = [probes[4]]
    if "kv" in wanted:
        compare_kv(probes[4], base, one_step)
        return
    if "calls" in wanted:
        compare_calls(probes[4], base, one_step)
        return
    variants = {
        "chunked": ([p], {}),
        "one_step": ([p], one_step),
        "one_step_three_times": ([p, p, p], one_step),
        "one_step_unpadded": ([p], {**one_step, "prefill_graph_sizes": (1, 2, 4, 8, 16, 300, 8192)}),
        "one_step_one_seq": ([p], {**one_step, "max_num_seqs": 1}),
        "one_step_piecewise": ([p], {**one_step, "whole_step_graphs": False}),
        "one_step_no_graphs": ([p], {**one_step, "cuda_graphs": False}),
    }
    ref = None
    for name, (groups, over) in variants.items():
        if ref is not None and wanted and name not in wanted:
            continue
        _, seen, stats, _ = workers.engine_logits(TPContext.single("cuda"), groups, {**base, **over}, by_group=True)
        for g, group in enumerate(seen):
            keys = sorted((k for k in group if k[:300] == tuple(probes[4])), key=len)
            if ref is None:
                ref = {k: group[k] for k in keys}
            same = ["=" if torch.equal(group[k], ref[k]) else f"x{(group[k].float() - ref[k].float()).abs().max():.3g}"
                    for k in ref]  # fmt: skip
            print(f"{name + (f' #{g}' if len(seen) > 1 else ''):26s} {' '.join(same)}  stats={stats}", flush=True)


if __name__ == "__main__":
    main()
