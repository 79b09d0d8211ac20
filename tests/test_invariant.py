"""Batch invariance on CPU (CompileOptions(invariant="batch"), ops/invariant.py, compiler/invariant.py): a token's
logits bitwise the same whatever else shares its call, through the kernels, the compiled model and the engine
(chunked prefill, mixed steps, padding, preemption)."""

import importlib.util
import random

import pytest
import torch

import tpweave
from tpweave import compiler
from tpweave.compiler import CompileOptions
from tpweave.engine import SamplingParams
from tpweave.models import build_model
from tpweave.models.inputs import pack
from tpweave.ops import fp8
from tpweave.runtime.context import TPContext

# dimensions at which torch's own fp32 CPU matmul gives a row different bits at different M
WIDE = dict(hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=4, head_dim=64)


def test_invariant_matmul_gives_a_row_the_same_bits_at_every_m_and_place():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(512, 1536, generator=g).to(dtype)
        x = torch.randn(1000, 512, generator=g).to(dtype)
        bias = torch.randn(1536, generator=g).to(dtype)
        row = x[7:8]
        alone = torch.ops.tpweave.invariant_mm(row, w)
        alone_b = torch.ops.tpweave.invariant_addmm(bias, row, w)
        for m in (8, 9, 16, 17, 129, 1000):
            assert torch.equal(torch.ops.tpweave.invariant_mm(x[:m], w)[7:8], alone), (dtype, m)
            assert torch.equal(torch.ops.tpweave.invariant_addmm(bias, x[:m], w)[7:8], alone_b), (dtype, m)
        shifted = torch.cat([x[:3], row, x[100:400]])  # the row at another place in its tile
        assert torch.equal(torch.ops.tpweave.invariant_mm(shifted, w)[3:4], alone)
        assert torch.allclose(alone.float(), (row @ w).float(), rtol=1e-2, atol=1e-1)


def test_tp_level_reports_a_sum_over_ranks_of_a_batched_product():
    """invariant="tp": a batched matmul keeps its batch form (no tree product), so a sum over ranks of its product
    (e.g. experts' down projections as a bmm, summed across ranks) is not the TP=1 product's: it is reported, while
    a plain matmul and its all-reduce become one tree op."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tpweave.compiler.invariant import make_batch_invariant
    from tpweave.compiler.report import GraphReport

    tpw = torch.ops.tpweave

    def batched(a, b):
        return tpw.all_reduce(torch.bmm(a, b).view(-1, 8), "0", 2, "ordered_tp")

    def plain(a, b):
        return tpw.all_reduce(torch.mm(a[0], b[0]), "0", 2, "ordered_tp")

    left = {}
    for fn in (batched, plain):
        gm = make_fx(fn, tracing_mode="fake")(torch.randn(2, 3, 4), torch.randn(2, 4, 8))
        report = GraphReport(variant="plain")
        make_batch_invariant(gm.graph, report=report, strict=False, level="tp")
        left[fn.__name__] = report.invariant
    key = "tpweave.all_reduce.default of a matmul's product (tp level: not summed in the product's tree)"
    assert left["batched"]["not_invariant"].get(key) == 1, left
    assert left["batched"]["swapped"] == {"aten.bmm.default": 1}, left
    assert left["plain"] == {"swapped": {"mm + tpweave.all_reduce.default": 1}, "not_invariant": {}}, left


def test_tp_level_sums_a_product_in_its_tree_when_its_size_is_read_too():
    """invariant="tp" at TP 2 on a model whose MLP runs on its tokens flattened (a Hugging Face MoE block's shared
    expert: Qwen3-Next, ERNIE 4.5 MoE): the SP graph reads the down projection's row count (a sym_size of the product,
    (B * S) being no graph input), and the product still goes into its reduce-scatter's tree, its size read off its
    input. Unfused, its ranks' parts were each rounded alone in some graphs and summed in the tree in others: a
    sequence's logits alone and in batches differed. Now they are bitwise the same, and TP 1's."""
    import workers

    one = tpweave.launch(workers.flat_mlp_invariant_logits, nprocs=1, timeout_s=300)[0]
    two = tpweave.launch(workers.flat_mlp_invariant_logits, nprocs=2, timeout_s=300)[0]
    for outs, eager, swaps, _ in (one, two):
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), [(o - outs[0]).abs().max() for o in outs[1:]]
        torch.testing.assert_close(outs[0], eager)
        assert all(s["not_invariant"] == {} for s in swaps), swaps
    assert two[3].get("sp") == 3, two[3]
    # the batches' graph: each layer's MLP product and its reduce-scatter one op (the others through async TP's mm_rs)
    assert any(s["swapped"].get("mm + tpweave.reduce_scatter_tokens.default") == 2 for s in two[2]), two[2]
    assert torch.equal(two[0][0], one[0][0]), (two[0][0] - one[0][0]).abs().max()


def test_tp_level_products_of_any_width_compile():
    """invariant="tp" on N not a multiple of the tree product's 64-column tiles (48, 100): the ops return contiguous
    tensors as their fakes say (Inductor checks the strides of every op it calls), and the numbers are the product's.
    """

    class Linears(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 48), torch.nn.Linear(48, 100, bias=False)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = Linears().eval()
    compiled = compiler.compile(model, options=CompileOptions(invariant="tp", strict=True))
    with torch.no_grad():
        for m in (1, 5, 37):
            x = torch.randn(m, 64)
            torch.testing.assert_close(compiled(x), model(x))
    swapped = [g.invariant["swapped"] for g in tpweave.report(compiled).graphs]
    assert all(s.get("aten.mm.default") == 1 and s.get("aten.addmm.default") == 1 for s in swapped), swapped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_attention_is_the_same_in_prefill_chunks_decode_and_packing(dtype):
    """Each query of a 150-token sequence: prefilled whole, prefilled in chunks after cached context, decoded one by
    one, packed beside another sequence: the same bits, and within rounding of the reference attention."""
    g = torch.Generator().manual_seed(1)
    num_heads, num_kv, dim, length, bs = 4, 2, 16, 150, 16
    q, k, v = (torch.randn(length, h, dim, generator=g).to(dtype) for h in (num_heads, num_kv, num_kv))
    scale = dim**-0.5
    whole = torch.ops.tpweave.invariant_attention(q, k, v, torch.tensor([0, length]), scale)
    ref = torch.ops.tpweave.attention(q, k, v, torch.tensor([0, length]), scale)
    assert torch.allclose(whole.float(), ref.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    other = [torch.randn(33, h, dim, generator=g).to(dtype) for h in (num_heads, num_kv, num_kv)]
    packed = torch.ops.tpweave.invariant_attention(
        *(torch.cat([o, t]) for o, t in zip(other, (q, k, v))), torch.tensor([0, 33, 33 + length]), scale
    )
    assert torch.equal(packed[33:], whole)
    tables = torch.arange(16, dtype=torch.int32)[None]
    for steps in ([length], [64, 1, 37, 48], [100] + [1] * 50):  # prefill; chunks and a decode; decodes
        kc, vc = (torch.zeros(16 * bs, num_kv, dim, dtype=dtype) for _ in range(2))
        outs, start = [], 0
        for n in steps:
            rows = slice(start, start + n)
            outs.append(torch.ops.tpweave.invariant_paged_attention(
                q[rows], k[rows], v[rows], kc, vc, torch.arange(start, start + n), torch.tensor([0, n]),
                torch.tensor([start + n]), tables, bs, scale,
            ))  # fmt: skip
            start += n
        assert torch.equal(torch.cat(outs), whole), steps


@pytest.mark.parametrize("op", ["paged_attention", "invariant_paged_attention"])
def test_paged_attention_ops_refuse_bad_optional_arguments(op):
    """Both paged ops (the default and its invariant swap) name the argument at fault: `fresh` must be one bool
    (read on the host), and RoPE's cos_sin and positions come together."""
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    pool = (torch.zeros(16, 1, 8), torch.zeros(16, 1, 8))
    args = (
        q,
        k,
        k,
        *pool,
        torch.arange(4),
        torch.tensor([0, 4]),
        torch.tensor([4]),
        torch.zeros(1, 1, dtype=torch.int32),
        16,
        0.3,
    )
    call = getattr(torch.ops.tpweave, op)
    with pytest.raises(ValueError, match=f"{op}: fresh must be one bool on the CPU, got 2"):
        call(*args, None, None, torch.tensor([True, True]))
    with pytest.raises(ValueError, match=f"{op}: cos_sin and positions go together"):
        call(*args, torch.randn(8, 8), None, None)
    assert torch.equal(call(*args, None, None, torch.tensor(True)), call(*args, None, None, torch.tensor(False)))


@pytest.mark.parametrize(
    "device,dtype", [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu(gpus=1))]
)
def test_compiled_model_logits_do_not_depend_on_the_batch(device, dtype):
    """Our Llama compiled with invariant="batch": a sequence's logits alone (M = 1 to 37) and packed with others at M
    from 6 to 1051, at several places; the report names what was swapped: on CUDA the MLPs' down projections with
    their activation (tpweave::invariant_gated_mm: the default mode's activation kernel, then the product)."""
    torch._dynamo.reset()  # Dynamo's recompile limit counts every compile of this model class in the process
    model = build_model("tiny", tp=TPContext.single(device), dtype=dtype, **WIDE)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    compiled = compiler.compile(model, options=CompileOptions(invariant="batch", strict=True))
    others = [torch.randint(0, vocab, (n,), generator=g) for n in (5, 100, 250, 3, 64, 600)]
    with torch.no_grad():
        for length in (1, 3, 6, 37):
            target = torch.randint(0, vocab, (length,), generator=g)
            alone = compiled(*pack([target], device=device).args())
            for layout in ([0, 1], [1, 0], [2, 0, 3], [4, 3, 0, 5], [6, 3, 0, 5, 2]):
                seqs = [target if i == 0 else others[i - 1] for i in layout]
                start = sum(len(s) for s in seqs[: layout.index(0)])
                got = compiled(*pack(seqs, device=device).args())[start : start + length]
                assert torch.equal(got, alone), (length, layout, (got - alone).abs().max())
            eager = model(*pack([target], device=device).args())
            tol = dict(atol=1e-4, rtol=0) if device == "cpu" else dict(atol=0.1, rtol=0.05)  # bf16: other kernels
            torch.testing.assert_close(alone, eager, **tol)
    swapped = [gr.invariant["swapped"] for gr in tpweave.report(compiled).graphs]
    gated = 2 if device == "cuda" else 0  # one a layer
    assert all(s.get("silu(gate) * up + mm", 0) == gated for s in swapped), swapped
    assert all(s.get("aten.mm.default", 0) >= 9 - gated and s.get("tpweave.attention.default") == 2 for s in swapped)


def _engine_logits(prompts, config, *, pad_to=None, device="cpu", params=None):
    """Greedy generation of `prompts` by a TP=1 engine, with the logits row of every sampled token keyed by the
    tokens it was computed from (workers.engine_logits)."""
    import workers

    results, seen, _engine_logits.step_stats, _ = workers.engine_logits(
        TPContext.single(device), [prompts], config, pad_to=pad_to, params=params
    )
    return results[0], seen


@pytest.mark.parametrize(
    "device,dtype", [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu(gpus=1))]
)
def test_engine_request_logits_alone_equal_among_others(device, dtype):
    """Each request alone, then all together in steps of at most 16 tokens (chunked prefill, mixed steps), with too
    few KV blocks for all (preemption), and with steps padded as for piecewise graphs: every sampled token's logits
    bitwise the same as alone (on a GPU: ops/invariant_kernels.py's kernels, its decode CUDA graphs, and its prefill
    and mixed steps from graphs of the whole step, their sequences padded with empty ones, or piecewise graphs)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1536) for _ in range(n)] for n in (1, 7, 13, 30, 45)]
    config = dict(dtype=dtype, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                  async_scheduling=False, invariant="batch", model_overrides=WIDE)  # fmt: skip
    params = SamplingParams(max_tokens=6, logprobs=3)
    alone, alone_logprobs = {}, []
    for p in prompts:
        (result,), seen = _engine_logits([p], {**config, "num_blocks": 32}, device=device, params=params)
        alone.update(seen)
        alone_logprobs.append(result["logprobs"])
        # the reported logprobs are the logits' log_softmax in fp32: the sampled token's, then the 3 most likely
        for j, lp in enumerate(result["logprobs"]):
            row = torch.log_softmax(seen[tuple(p + result["token_ids"][:j])].float(), -1)
            assert lp.logprob == row[result["token_ids"][j]].item() and len(lp.top) == 3
            assert [i for i, _ in lp.top] == row.topk(3).indices.tolist() and lp.top[0][1] == row.max().item()
    preempted = 0
    runs = [(32, None, True), (16, (16,), True), (16, None, True)]
    if device == "cuda":
        runs.append((16, None, False))  # piecewise graphs rather than whole-step ones
    for blocks, pad_to, whole in runs:
        results, seen = _engine_logits(prompts, {**config, "num_blocks": blocks, "whole_step_graphs": whole},
                                       pad_to=pad_to, device=device, params=params)  # fmt: skip
        assert all(len(r["token_ids"]) == 6 for r in results)
        assert [r["logprobs"] for r in results] == alone_logprobs  # bitwise: floats compared with ==
        preempted += sum(r["num_preemptions"] for r in results)
        assert set(seen) <= set(alone) and len(seen) == len(alone) == 5 * 6
        for key, logits in seen.items():
            assert torch.equal(logits, alone[key]), (blocks, pad_to, len(key))
        if device == "cuda":  # the graph paths ran: decode graphs, and whole-step or piecewise prefill graphs
            stats = _engine_logits.step_stats
            assert stats["decode_graph"] > 0 and stats["whole_graph" if whole else "piecewise"] > 0, stats
            assert stats["eager"] == 0, stats
    assert preempted > 0  # 16 blocks of 4 cannot hold all five at once


def test_invariant_engines_of_any_token_budget_first_call_each_graph_at_one_size(monkeypatch):
    """Inductor picks a reduction's kernel configuration (the order of a row's sum) from the size hint of its rows, the
    M a graph is first called with: an engine whose first step is its token budget's would reduce a norm's row unlike
    an engine of another budget (on one H100: a 300-token prompt, one row of 300). In invariant mode every engine
    calls each graph variant first at one token count, the same for every budget and workload; the default mode does
    not spend those calls."""
    from tpweave.compiler.compiled import CompiledTP
    from tpweave.engine import LLMEngine, SamplingParams

    firsts = []
    call = CompiledTP.__call__

    def recording_call(self, *args, **kwargs):
        firsts.append(args[0].shape[0])
        return call(self, *args, **kwargs)

    monkeypatch.setattr(CompiledTP, "__call__", recording_call)
    config = dict(dtype=torch.float32, block_size=4, max_num_seqs=4, max_model_len=64, num_blocks=64)
    for invariant, budget, prompt in (("batch", 16, 13), ("batch", 64, 40), (None, 64, 40)):
        torch._dynamo.reset()  # Dynamo's recompile limit counts every compile of this model class in the process
        firsts.clear()
        engine = LLMEngine(TPContext.single("cpu"), "tiny", invariant=invariant, max_num_batched_tokens=budget,
                           **config)  # fmt: skip
        engine.generate([list(range(prompt))], SamplingParams(max_tokens=2))
        steps = firsts[1:] if invariant else firsts  # the prompt's prefill, then decode steps
        assert steps[:2] == [prompt, 1], firsts
        assert not invariant or firsts[0] == 10, firsts  # two sequences of a block and a token
    torch._dynamo.reset()


@pytest.mark.gpu(gpus=1)
def test_engine_request_alone_equals_among_64_and_256_others_on_the_gpu():
    """The TP=1 engine in bf16 with its CUDA graphs: five requests of 1 to 300 tokens, each alone, then among 64
    other requests of other lengths in steps of at most 256 tokens (the longest prompt chunked; mixed steps), then
    among 256 in steps of up to 8192 tokens with KV blocks for about half of what they would use (decode steps of
    256 sequences: the matmul's larger launch shapes; preemption): each one's greedy tokens and the logits of every
    token sampled (so any logprobs) bitwise the same."""
    import workers

    rng = random.Random(3)
    probes = [[rng.randrange(1536) for _ in range(n)] for n in (1, 9, 40, 130, 300)]
    others = [[rng.randrange(1536) for _ in range(rng.randrange(1, 40))] for _ in range(256)]
    config = dict(dtype=torch.bfloat16, block_size=16, max_num_seqs=256, max_num_batched_tokens=256,
                  max_model_len=320, num_blocks=2000, async_scheduling=False, invariant="batch",
                  model_overrides=WIDE)  # fmt: skip
    groups = [[p] for p in probes] + [probes + others[:64]]
    results, seen, stats, _ = workers.engine_logits(TPContext.single("cuda"), groups, config, by_group=True)
    crowd = {**config, "max_num_batched_tokens": 8192, "num_blocks": 500}
    (crowded,), (crowded_seen,), crowded_stats, _ = workers.engine_logits(TPContext.single("cuda"), [probes + others],
                                                                          crowd, by_group=True)  # fmt: skip
    alone = {k: v for group in seen[: len(probes)] for k, v in group.items()}
    assert len(alone) == 6 * len(probes)
    for name, outs, among in (("64", results[-1], seen[-1]), ("256", crowded, crowded_seen)):
        for i, out in enumerate(outs[: len(probes)]):
            assert out["token_ids"] == results[i][0]["token_ids"], (name, i)
        for key, logits in alone.items():
            assert torch.equal(among[key], logits), (name, len(key))
    assert stats["most_seqs"] >= 64 and crowded_stats["most_seqs"] == 256, (stats, crowded_stats)
    assert sum(r["num_preemptions"] for r in crowded) > 0
    for st in (stats, crowded_stats):
        assert st["decode_graph"] > 0 and st["whole_graph"] > 0 and st["eager"] == 0, st


def test_engine_at_tp_2_gives_each_request_the_logits_it_has_alone_at_tp_1():
    """invariant="tp", the engine at TP 2 (gloo) against TP 1: the requests together, in steps of at most 16 tokens
    (chunked prefill, mixed steps, decodes; the plain graph below 4 tokens, token split from 4, SP and async TP at
    16; each ran) and with too few KV blocks for all (preemption), give every sampled token the logits bits it has at
    TP 1 with each request alone."""
    import workers

    rng = random.Random(2)
    prompts = [[rng.randrange(1536) for _ in range(n)] for n in (1, 7, 13, 30, 45)]
    config = dict(dtype=torch.float32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                  num_blocks=16, async_scheduling=False, invariant="tp", model_overrides=WIDE, sp_min_tokens=16,
                  token_split_min_tokens=4)  # fmt: skip
    _, alone, _, _ = workers.engine_logits(TPContext.single(), [[p] for p in prompts], {**config, "num_blocks": 32})
    ranks = tpweave.launch(workers.engine_logits, [prompts], config, nprocs=2, timeout_s=600)
    (results,), together, _, calls = ranks[0]
    assert sum(r["num_preemptions"] for r in results) > 0
    assert all(calls.get(variant, 0) > 0 for variant in ("plain", "split", "sp")), calls
    assert set(together) == set(alone) and len(alone) == 5 * 6
    for key, logits in together.items():
        assert torch.equal(logits, alone[key]), (len(key), (logits - alone[key]).abs().max())


def test_a_seeded_request_samples_the_same_tokens_whatever_came_in_before_it():
    """Temperature sampling with a seed under invariant="batch": a request alone and submitted last among others
    draws the same tokens (its logits are the same, and its random stream is its seed's)."""
    from tpweave.engine import SamplingParams

    rng = random.Random(1)
    prompts = [[rng.randrange(1536) for _ in range(n)] for n in (9, 4, 21)]
    config = dict(dtype=torch.float32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                  num_blocks=32, async_scheduling=False, invariant="batch")  # fmt: skip
    params = SamplingParams(temperature=0.9, max_tokens=8, seed=5)
    alone, _ = _engine_logits(prompts[:1], config, params=params)
    together, _ = _engine_logits(prompts[1:] + prompts[:1], config, params=params)
    assert together[-1]["token_ids"] == alone[0]["token_ids"]
    assert together[0]["token_ids"] != together[1]["token_ids"]  # the draws are random, not greedy


def test_logits_do_not_depend_on_the_batch_or_the_graph_at_tp_4():
    """At TP 4 (gloo; TP 2 is the Hugging Face test's): a sequence's logits alone and packed with others at M up to
    420, through the plain graph (M < 4: its all-reduces), the token-split graph (M from 4 to 63: two token subsets,
    each one's all-reduce in flight under the other's matmuls) and the SP graph (M from 64 on: reduce-scatter, norm on
    a shard, all-gather; async TP's matmul + scatter and gather + matmul under `ordered`): bitwise equal, every sum
    across ranks in rank order (with the backend's order they differ). The split graph sums by all-gathers it orders
    itself: no backend all-reduce is left in it, and each all-gather (but the last) still has the other subset's
    matmuls between its start and its wait."""
    import workers
    from test_compiler import uninterleaved_all_reduces

    results = tpweave.launch(workers.invariant_logits, 64, 4, nprocs=4, timeout_s=600)
    assert results[0] == results[1]
    equal, worst, calls, collectives, schedules = results[0]
    assert all(equal) and worst == 0.0, (equal, worst)
    assert calls.get("plain", 0) > 0 and calls.get("split", 0) > 0 and calls.get("sp", 0) > 0, calls
    assert collectives["split"] and all(c.get("all_reduce", 0) == 0 for c in collectives["split"]), collectives
    # async TP on in the SP graph: every matmul beside a gather or a scatter fused with it
    assert all(c.get("ag_mm", 0) >= 4 and c.get("mm_rs") == 4 and not c.get("reduce_scatter_tokens")
               for c in collectives["sp"]), collectives  # fmt: skip
    for schedule in schedules["split"]:
        assert schedule.count("all_reduce A") == schedule.count("all_reduce B") > 1, schedule
        assert uninterleaved_all_reduces(schedule) == [], schedule


@pytest.mark.parametrize("tp", [1, 2])
def test_hugging_face_llama_under_its_own_tp_plan_is_batch_invariant(tmp_path, tp):
    """transformers' Llama (tp_plan="auto" at TP 2), its forward compiled with invariant="batch", strict: a prompt's
    logits alone and in right-padded batches (its SDPA swapped for tpweave's, every matmul and sum too)."""
    import workers

    if tp == 1:
        results = [workers.hf_invariant_logits(TPContext.single(), str(tmp_path))]
    else:
        results = tpweave.launch(workers.hf_invariant_logits, str(tmp_path), nprocs=tp, timeout_s=600)
    equal, swaps, calls, _ = results[0]
    assert all(equal), equal
    assert all(s["not_invariant"] == {} and s["swapped"].get("aten._scaled_dot_product_flash_attention_for_cpu.default")
               for s in swaps), swaps  # fmt: skip
    if tp > 1:
        assert calls.get("sp", 0) > 0 and calls.get("plain", 0) > 0, calls


def test_hugging_face_llama_under_its_own_tp_plan_gives_tp_1s_bits_at_tp_4(tmp_path):
    """invariant="tp", transformers' Llama under its own TP plan: a prompt's logits at TP 4 (two of the tree's 8 K
    chunks a rank; plain and SP graphs: each row-parallel product reaches its sum through a (B, S, N) reshape; the SP
    graph's under async TP's `ordered_tp`) bitwise those at TP 1, alone and batch-invariant in right-padded batches;
    in the plain graph each row-parallel product and its sum one op (the report). (TP 2 at this level: our Llama's
    tests; transformers' Llama at TP 2: the batch level's.)"""
    import workers

    one = workers.hf_invariant_logits(TPContext.single(), str(tmp_path / "one"), "tp")
    many = tpweave.launch(workers.hf_invariant_logits, str(tmp_path / "many"), "tp", nprocs=4, timeout_s=600)[0]
    for equal, swaps, _, _ in (one, many):
        assert all(equal) and all(s["not_invariant"] == {} for s in swaps), (equal, swaps)
    assert any(s["swapped"].get("mm + tpweave.all_reduce.default") == 4 for s in many[1]), many[1]
    for want, got in zip(one[3], many[3], strict=True):
        assert torch.equal(got, want), (got - want).abs().max()


def test_hugging_face_llama_prefill_chunks_and_decodes_through_its_kv_cache_give_the_same_bits(tmp_path):
    """invariant="batch", transformers' Llama at TP 1: a prompt's logits from one prefill bitwise those of a prefill, a
    chunk and single-token decodes through HF's KV cache. (At TP 2 under its own TP plan Dynamo cannot trace a decode
    through the cache, on torch 2.13: "unhashable type: non-nested SymInt" in the sharded embedding; invariant mode
    then refuses the call rather than answer it eagerly.)"""
    import workers

    for rows, equal, worst in workers.hf_invariant_cache_logits(TPContext.single(), str(tmp_path), "batch"):
        assert equal, (rows, worst)


def test_logits_do_not_depend_on_the_tp_degree():
    """invariant="tp": our Llama's logits for a sequence alone (M = 37) and packed (M = 52: at TP >= 2 both through the
    token-split graph, each subset's row-parallel products' fp32 subtrees all-gathered under the other subset's
    matmuls) and in a batch of M = 420 (the SP graph, async TP's ops under `ordered_tp`) bitwise the same at TP 1, 2
    and 4 (every matmul a tree over 8 K chunks, a row-parallel layer's ranks summing the subtrees); and the same with
    invariant="batch" differ across TP."""
    import workers
    from test_compiler import uninterleaved_all_reduces

    # each rank compiles three graph variants as it first meets them, while the others may already wait in the
    # variant's collectives: on a loaded 2-core CI machine one rank's compile trailed the other's by over the default
    # 120 s once (a gloo send timeout at TP 2), so the collectives here wait up to 300 s
    waits = dict(timeout_s=600, collective_timeout_s=300)
    one, calls, _, _ = workers.tp_invariant_logits(TPContext.single(), "tp")
    assert calls["plain"] == 3 and not calls.get("split") and not calls.get("sp"), calls
    for tp in (2, 4):
        got, calls, collectives, schedules = tpweave.launch(workers.tp_invariant_logits, "tp", nprocs=tp, **waits)[0]
        assert calls == {"plain": 0, "split": 2, "sp": 1}, calls
        for (name, want), (_, logits) in zip(one, got, strict=True):
            assert torch.equal(logits, want), (tp, name, (logits - want).abs().max())
        assert all(c.get("all_reduce", 0) == 0 for c in collectives["split"]), collectives
        assert all(c.get("ag_mm", 0) >= 4 and c.get("mm_rs") == 4 for c in collectives["sp"]), collectives  # async TP
        for schedule in schedules["split"]:
            assert schedule.count("all_reduce A") == schedule.count("all_reduce B") > 1, schedule
            assert uninterleaved_all_reduces(schedule) == [], schedule
    batch_one = workers.tp_invariant_logits(TPContext.single(), "batch")[0]
    batch_two = tpweave.launch(workers.tp_invariant_logits, "batch", nprocs=2, **waits)[0][0]
    assert not all(torch.equal(a, b) for (_, a), (_, b) in zip(batch_one, batch_two))


def test_invariant_options_refuse_what_is_not_built():
    from tpweave.compiler.options import PLAIN_TP, plan
    from tpweave.compiler.tp_group import TPGroup
    from tpweave.engine.config import EngineConfig
    from tpweave.ops.strategies.ordered import BY_LEVEL

    with pytest.raises(ValueError, match="invariant must be one of"):
        CompileOptions(invariant="yes")
    two = plan(CompileOptions(invariant="batch", token_split_min_tokens=4), TPGroup("g", 0, 2, "nccl"), None)
    assert two.variants["plain"].all_reduce_policy == "ordered" and two.token_split_min_tokens == 4
    # token split stays on at both levels, its side stream's fused all-reduce + norm (the kernel's own sum) off
    assert two.variants["split"].invariant == "batch" and two.variants["split"].token_split_sms == 0
    tp_two = plan(CompileOptions(invariant="tp", token_split_min_tokens=4), TPGroup("g", 0, 2, "nccl"), None)
    assert tp_two.token_split_min_tokens == 4 and tp_two.variants["split"].invariant == "tp"
    assert two.variants["plain"].all_reduce_rms_norm_policy == "sequential"
    # async TP stays on, its ops under the level's ordered strategy
    assert two.variants["sp"].async_tp and two.variants["sp"].policies(("ag_mm", "mm_rs")) == ["ordered"] * 2
    assert tp_two.variants["sp"].async_tp and tp_two.variants["sp"].policies(("ag_mm", "mm_rs")) == ["ordered_tp"] * 2
    assert tp_two.variants["plain"].all_reduce_policy == "ordered_tp"
    # plain TP in invariant mode (the engine's baseline=True, `bench engine --baseline --invariant`: what the TP >= 2
    # cost of SP + async TP is measured against): one graph, no token split, its all-reduces the ordered strategy's
    for level in ("batch", "tp"):
        plain = plan(PLAIN_TP.replace({"invariant": level}), TPGroup("g", 0, 2, "nccl"), None)
        assert set(plain.variants) == {"plain"} and plain.token_split_min_tokens is None, level
        assert plain.variants["plain"].all_reduce_policy == BY_LEVEL[level], level
        assert plain.variants["plain"].all_reduce_rms_norm_policy == "sequential", level
    from tpweave.ops.strategies import STRATEGIES

    assert not STRATEGIES["ordered"].candidate  # a guarantee, never timed by calibration as a candidate for speed
    one = plan(CompileOptions(invariant="batch"), TPGroup("", 0, 1, "none"), None)
    assert one.variants["plain"].invariant == "batch" and not one.variants["plain"].decode_gemv
    with pytest.raises(ValueError, match="compile_model=True"):
        EngineConfig(invariant="tp", compile_model=False)
    with pytest.raises(ValueError, match="compile_model=True"):
        EngineConfig(invariant="batch", compile_model=False)


def test_an_op_the_pass_cannot_make_invariant_is_reported_or_raises():
    class Scaled(torch.nn.Module):  # torch's FP8 matmul: its kernel depends on the shape
        def forward(self, x, w):
            one = torch.ones((), dtype=torch.float32)
            xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
            return torch._scaled_mm(xq, wq.t(), one, one, out_dtype=torch.float32) @ w

    x, w = torch.randn(16, 32), torch.randn(32, 32)
    loose = compiler.compile(Scaled(), options=CompileOptions(invariant="batch"))
    torch.testing.assert_close(loose(x, w), Scaled()(x, w))
    report = tpweave.report(loose).graphs[0]
    assert report.invariant["not_invariant"] == {"aten._scaled_mm.default": 1}
    assert report.invariant["swapped"] == {"aten.mm.default": 1}
    assert any("not batch-invariant: aten._scaled_mm.default x1" in n for n in report.notes)
    strict = compiler.compile(Scaled(), options=CompileOptions(invariant="batch", strict=True))
    with pytest.raises(Exception, match="not batch-invariant"):
        strict(x, w)

    class Fp8(torch.nn.Module):  # an FP8 linear (ops/fp8.py): the matmul is torch._scaled_mm inside a custom op
        def forward(self, x, wq, ws):
            xq, xs = fp8.quantize_rows(x)
            return fp8.scaled_mm(xq, wq, xs, ws, None, torch.float32)

    wq, ws = fp8.quantize_weight(torch.randn(16, 8), per_channel=True)
    fp8_model = compiler.compile(Fp8(), options=CompileOptions(invariant="batch"))
    fp8_model(torch.randn(5, 8), wq, ws)
    assert tpweave.report(fp8_model).graphs[0].invariant["not_invariant"] == {"tpweave.scaled_mm.default": 1}

    # an op of another library: what it does across rows is unknown (a mixture of experts' grouped matmul is
    # batch-dependent; this one subtracts the mean over the rows)
    class Foreign(torch.nn.Module):
        def forward(self, x):
            return _rows_centered(x @ x.T)

    foreign = compiler.compile(Foreign(), options=CompileOptions(invariant="batch"))
    a, b = torch.randn(3, 8), torch.randn(5, 8)
    assert not torch.equal(foreign(a)[0], foreign(torch.cat([a, b]))[0])  # what the report warns of
    left = tpweave.report(foreign).graphs[0].invariant["not_invariant"]
    assert list(left) == ["tpwtest.rows_centered.default (not tpweave's nor torch's: not known to be invariant)"], left
    with pytest.raises(Exception, match="rows_centered"):
        compiler.compile(Foreign(), options=CompileOptions(invariant="batch", strict=True))(a)


class _Experts(torch.nn.Module):
    """A mixture of experts as transformers runs one: a router, each token's top 2 experts, the tokens sorted by expert
    and the experts' products as one grouped matmul (torch's `_grouped_mm`, or transformers' CPU fallback op)."""

    def __init__(self, grouped_mm):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.router = torch.nn.Parameter(torch.randn(512, 4, generator=g) / 16, requires_grad=False)
        self.w = torch.nn.Parameter(torch.randn(4, 512, 384, generator=g) / 16, requires_grad=False)
        self.grouped_mm = grouped_mm

    def forward(self, x):
        weights, experts = torch.topk(torch.softmax(x @ self.router, dim=-1), 2)
        order = torch.sort(experts.reshape(-1), stable=True).indices
        counts = (experts.reshape(-1, 1) == torch.arange(4, device=x.device)).sum(0)  # no host sync, unlike bincount
        offs = torch.cumsum(counts, 0).to(torch.int32)
        y = self.grouped_mm(x[order // 2], self.w, offs)
        out = torch.empty_like(y)
        out[order] = y * weights.reshape(-1)[order, None]
        return out.view(-1, 2, 384).sum(1)


def test_a_mixture_of_experts_grouped_matmul_is_made_invariant():
    """A grouped matmul (each expert's rows @ its weight: as many rows as tokens were routed to it) becomes
    tpweave::invariant_grouped_mm, each group through the invariant row tiles: a token's output alone is the same
    bits as among others, at both levels; the numbers are the model's. transformers' CPU fallback op included."""
    # {op: (the grouped matmul, dtype)}: torch's takes bf16 (its meta function refuses fp32)
    ops = {"aten._grouped_mm.default": (lambda a, b, offs: torch._grouped_mm(a, b, offs=offs), torch.bfloat16)}
    if importlib.util.find_spec("transformers") is not None:
        from transformers.integrations import moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

        ops["transformers.grouped_mm_fallback.default"] = (
            lambda a, b, offs: torch.ops.transformers.grouped_mm_fallback(a, b, offs=offs),
            torch.float32,
        )
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(1))
    for name, (grouped_mm, dtype) in ops.items():
        model, x = _Experts(grouped_mm).to(dtype), x.to(dtype)
        for level in ("batch", "tp"):
            compiled = compiler.compile(model, options=CompileOptions(invariant=level, strict=True))
            alone = compiled(x[:1])
            torch.testing.assert_close(alone, model(x[:1]), rtol=2e-2, atol=2e-2)
            for m in (7, 300):
                assert torch.equal(compiled(x[:m])[:1], alone), (name, level, m)
            swapped = tpweave.report(compiled).graphs[-1].invariant["swapped"]
            assert swapped.get(name) == 1, swapped


@pytest.mark.gpu(gpus=1)
def test_a_mixture_of_experts_grouped_matmul_is_one_launch_under_cuda_graphs_on_the_gpu(monkeypatch):
    """On the GPU (bf16) tpweave::invariant_grouped_mm is one launch with no host read: each expert's rows the bits of
    that expert's product alone (invariant_mm's; tp_invariant_mm's at "tp") whatever the routing. A mixture of experts
    compiled with Inductor's CUDA graph trees at both levels captures it: over replays, a token's output alone is the
    same bits as among others, the numbers the model's."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    tpw = torch.ops.tpweave
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(8, 1024, 768, device="cuda", generator=g, dtype=torch.bfloat16) / 32
    x = torch.randn(600, 1024, device="cuda", generator=g, dtype=torch.bfloat16)
    for s in (1, 5, 64, 600):
        counts = torch.bincount(torch.randint(0, 7, (s,), device="cuda", generator=g), minlength=8)  # expert 7 empty
        offs = counts.cumsum(0).to(torch.int32)
        bounds = [0, *offs.tolist()]
        for tree, alone in ((False, tpw.invariant_mm), (True, tpw.tp_invariant_mm)):
            got = tpw.invariant_grouped_mm(x[:s], w, offs, tree)
            for e in range(8):
                lo, hi = bounds[e], bounds[e + 1]
                assert torch.equal(got[lo:hi], alone(x[lo:hi], w[e])), (s, tree, e)
    recorded = []
    init = cudagraph_trees.CUDAGraphNode.__init__

    def counting_init(*args, **kwargs):
        recorded.append(1)
        init(*args, **kwargs)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphNode, "__init__", counting_init)
    model = _Experts(lambda a, b, offs: torch._grouped_mm(a, b, offs=offs)).to("cuda", torch.bfloat16)
    x = x[:300, :512]
    counters.clear()
    for level in ("batch", "tp"):
        compiled = compiler.compile(model, options=CompileOptions(invariant=level, strict=True, cudagraphs=True))
        before = len(recorded)
        for _ in range(3):  # warm-up, recording, replay
            torch.compiler.cudagraph_mark_step_begin()
            alone = compiled(x[:1]).clone()
            among = {m: compiled(x[:m])[:1].clone() for m in (7, 300)}
        assert len(recorded) - before >= 3, (level, len(recorded) - before)  # a graph for each of the three shapes
        torch.testing.assert_close(alone, model(x[:1]), rtol=2e-2, atol=2e-2)
        for m, first in among.items():
            assert torch.equal(first, alone), (level, m)
        swapped = tpweave.report(compiled).graphs[-1].invariant["swapped"]
        assert swapped.get("aten._grouped_mm.default") == 1, swapped
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu(gpus=1))])
def test_invariant_batched_matmul_gives_an_element_the_same_bits_at_every_shape_and_padded_k(device):
    """tpweave::invariant_bmm / invariant_baddbmm: an element's result depends on its row of a and its column of b
    alone: not on the batch, the rows, the columns, nor zeros appended to K (an attention's probabilities over a
    right-padded key length); the numbers are torch's. On a GPU, bf16 runs the Triton matmul, all matrices in one
    launch."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(12, 100, 150, generator=g).to(device, dtype)
        b = torch.randn(12, 150, 130, generator=g).to(device, dtype)
        bias = torch.randn(12, 1, 130, generator=g).to(device, dtype)
        a[..., 40:] = 0  # row 7's K: 40 values, then zeros
        alone = torch.ops.tpweave.invariant_bmm(a[3:4, 7:8, :40], b[3:4, :40, 5:6])
        alone_b = torch.ops.tpweave.invariant_baddbmm(bias[3:4, :, 5:6], a[3:4, 7:8, :40], b[3:4, :40, 5:6], 0.5, 0.3)
        for nb, m, k, n in ((4, 8, 40, 6), (4, 9, 64, 17), (12, 100, 65, 130), (12, 100, 150, 130)):
            got = torch.ops.tpweave.invariant_bmm(a[:nb, :m, :k], b[:nb, :k, :n])
            assert torch.equal(got[3:4, 7:8, 5:6], alone), (dtype, nb, m, k, n)
            got = torch.ops.tpweave.invariant_baddbmm(bias[:nb, :, :n], a[:nb, :m, :k], b[:nb, :k, :n], 0.5, 0.3)
            assert torch.equal(got[3:4, 7:8, 5:6], alone_b), (dtype, nb, m, k, n)
        want = torch.baddbmm(bias.float(), a.float(), b.float(), beta=0.5, alpha=0.3)
        got = torch.ops.tpweave.invariant_baddbmm(bias, a, b, 0.5, 0.3)
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-1)
        nan = torch.full_like(bias, float("nan"))  # beta 0: the input is not read (torch's baddbmm)
        tpw = torch.ops.tpweave
        assert torch.equal(tpw.invariant_baddbmm(nan, a, b, 0.0, 1.0), tpw.invariant_bmm(a, b))


class _EagerAttention(torch.nn.Module):
    """A Hugging Face model's eager attention: scores by torch.matmul (a bmm in the graph) or by baddbmm over an
    ALiBi-like bias (BLOOM), a causal and padding mask, softmax, torch.matmul with the values. sinks: a learned logit
    per head appended to each row of scores before the softmax and dropped after it (gpt-oss, HY-V4)."""

    def __init__(self, baddbmm: bool, sinks: bool = False, heads: int = 4, head_dim: int = 64, sink_max: bool = True):
        super().__init__()
        self.heads, self.head_dim, self.baddbmm, self.sink_max = heads, head_dim, baddbmm, sink_max
        self.qkv = torch.nn.Linear(heads * head_dim, 3 * heads * head_dim, bias=False)
        self.slopes = torch.nn.Parameter(torch.rand(heads, 1, 1))
        self.sinks = torch.nn.Parameter(torch.randn(heads)) if sinks else None

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        scale = self.head_dim**-0.5
        if self.baddbmm:
            alibi = (self.slopes * torch.arange(s, dtype=x.dtype)).repeat(b, 1, 1)  # (B * H, 1, S)
            flat = (b * self.heads, s, self.head_dim)
            scores = torch.baddbmm(alibi, q.reshape(flat), k.reshape(flat).transpose(1, 2), beta=1.0, alpha=scale)
            scores = scores.view(b, self.heads, s, s)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        keep = torch.ones(s, s, dtype=torch.bool).tril()[None, None] & mask[:, None, None, :].bool()
        scores = scores.masked_fill(~keep, float("-inf"))
        if self.sinks is None:
            p = torch.softmax(scores, dim=-1)
        else:  # the sink after the row's padded keys
            logits = torch.cat([scores, self.sinks.reshape(1, -1, 1, 1).expand(b, -1, s, 1)], dim=-1)
            if self.sink_max:  # gpt-oss subtracts the row's max itself; Flint leaves it to the softmax
                logits = logits - logits.max(dim=-1, keepdim=True).values
            p = torch.softmax(logits, dim=-1)[..., :-1]
        return torch.matmul(p, v).transpose(1, 2).reshape(b, s, -1)


@pytest.mark.parametrize(
    "baddbmm,sinks", [(False, False), (True, False), (False, True)], ids=["matmul", "baddbmm", "sinks"]
)
def test_eager_attention_batched_matmuls_are_made_invariant(baddbmm, sinks):
    """Eager attention's batched matmuls (compiler/invariant.py: bmm and baddbmm swapped for tpweave's): a sequence's
    outputs alone are the same bits as its row of a right-padded batch, whose padding keys are masked (the scores' and
    the values' products over the padded key length), at both levels; the numbers are the model's. With a sink logit
    after the padded keys, the softmax's sum is split at the concatenation (each part's padding trailing)."""
    torch.manual_seed(0)
    model = _EagerAttention(baddbmm, sinks).eval()
    g = torch.Generator().manual_seed(1)
    for level in ("batch", "tp"):
        torch._dynamo.reset()  # Dynamo's recompile limit counts every compile of this model class in the process
        compiled = compiler.compile(model, options=CompileOptions(invariant=level, strict=True))
        with torch.no_grad():
            for length in (1, 6, 37):
                target = torch.randn(1, length, 256, generator=g)
                alone = compiled(target, torch.ones(1, length))
                torch.testing.assert_close(alone, model(target, torch.ones(1, length)), rtol=1e-4, atol=1e-5)
                for others in ((40,), (100, 3)):
                    width = max(*others, length)
                    x, mask = torch.randn(len(others) + 1, width, 256, generator=g), torch.zeros(len(others) + 1, width)
                    for i, n in enumerate((*others, length)):
                        mask[i, :n] = 1
                    x[-1, :length] = target[0]
                    got = compiled(x, mask)[-1, :length]
                    assert torch.equal(got, alone[0]), (level, length, others, (got - alone[0]).abs().max())
        swapped = tpweave.report(compiled).graphs[-1].invariant["swapped"]
        assert swapped.get("aten.baddbmm.default" if baddbmm else "aten.bmm.default") == (1 if baddbmm else 2)
        split = [n for n in swapped if n.startswith("sum over a concatenation")]
        assert [swapped[n] for n in split] == ([1] if sinks else []), swapped


def test_a_sink_logit_one_element_a_row_gets_the_same_exp_alone_and_among_others():
    """Flint's attention: softmax over the scores with a sink logit appended, no max subtracted first. Inductor
    computed the sink's exp in a loop vectorized over the heads in a one-token prompt's graph (SLEEF's exp) and in a
    scalar loop among many rows (libm's), an ulp apart for some heads. In invariant mode no CPU kernel is vectorized
    (compiler/options.py _ONE_ROW_AS_MANY): a prompt's outputs alone are its row's among others; the model's numbers."""
    torch.manual_seed(0)
    model = _EagerAttention(False, sinks=True, heads=128, head_dim=4, sink_max=False).eval()
    g = torch.Generator().manual_seed(1)
    compiled = compiler.compile(model, options=CompileOptions(invariant="batch", strict=True))
    with torch.no_grad():
        for length in (1, 6):
            target = torch.randn(1, length, 512, generator=g)
            alone = compiled(target, torch.ones(1, length))
            torch.testing.assert_close(alone, model(target, torch.ones(1, length)), rtol=1e-4, atol=1e-5)
            x, mask = torch.randn(2, 40, 512, generator=g), torch.ones(2, 40)
            x[-1, :length], mask[-1, length:] = target[0], 0
            got = compiled(x, mask)[-1, :length]
            assert torch.equal(got, alone[0]), (length, (got - alone[0]).abs().max())


@torch.library.custom_op("tpwtest::rows_centered", mutates_args=())
def _rows_centered(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(0)


@_rows_centered.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_token_alone_is_reduced_as_among_others_layer_norm_and_a_long_softmax():
    """A token dim of size 1 gets a graph of its own. Inductor would reduce its one row otherwise than the dynamic
    graph's rows: a LayerNorm's variance by Welford there and in two steps for many rows, a long row's softmax split
    over the CPU's threads. In invariant mode (compiler/options.py _ONE_ROW_AS_MANY) a token's outputs are the same
    bits alone (B = S = 1) as at (1, 2) and among other sequences; the numbers are the model's."""

    class Norms(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(64)
            self.up = torch.nn.Linear(64, 4096)
            torch.nn.init.normal_(self.ln.weight)
            torch.nn.init.normal_(self.ln.bias)

        def forward(self, x):
            h = self.ln(x)
            return h, torch.softmax(self.up(h), dim=-1)

    torch.manual_seed(0)
    model = Norms().eval()
    compiled = compiler.compile(model, options=CompileOptions(invariant="batch", strict=True))
    token = torch.randn(64)
    with torch.no_grad():
        alone = compiled(token.view(1, 1, 64))
        torch.testing.assert_close(alone, model(token.view(1, 1, 64)))
        for shape in ((1, 2), (3, 5), (2, 1)):
            x = torch.randn(*shape, 64)
            x[-1, -1] = token
            for got, want in zip(compiled(x), alone, strict=True):
                assert torch.equal(got[-1, -1], want[0, 0]), (shape, (got[-1, -1] - want[0, 0]).abs().max())


def test_a_token_alone_is_reduced_as_among_others_a_short_softmax():
    """A reduction of fewer than 8 elements (a mixture of experts' router softmax over 4 experts) is unrolled by
    Inductor into a chain of adds, ((a + b) + c) + d, in the graph of many rows, but on the CPU stays a vectorized
    reduction, a tree over SIMD lanes, in the graph of one row. In invariant mode (compiler/options.py
    _ONE_ROW_AS_MANY) every token's router probabilities are the same bits alone as among others."""

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(64, 4, bias=False)

        def forward(self, x):
            return torch.softmax(self.gate(x).float(), dim=-1)

    torch.manual_seed(0)
    model = Router().eval()
    compiled = compiler.compile(model, options=CompileOptions(invariant="batch", strict=True))
    x = 4 * torch.randn(1, 48, 64)
    with torch.no_grad():
        together = compiled(x)
        for i in range(x.shape[1]):
            alone = compiled(x[:, i : i + 1])
            torch.testing.assert_close(alone, model(x[:, i : i + 1]))
            assert torch.equal(together[0, i], alone[0, 0]), (i, (together[0, i] - alone[0, 0]).abs().max())


def test_a_rotary_embedding_by_complex_multiplication_is_batch_invariant():
    """A rotary embedding by complex multiplication (Meta's Llama code, DeepSeek-V2, Llama 4): Inductor leaves a complex
    product to ATen, whose CPU kernel rounds the elements of its vector loop and those of its scalar tail otherwise, so
    a token's bits depended on the tensor's length (here the 4 last complex elements of a sequence of 5 or 37 tokens
    alone). In invariant mode the product is written out in real arithmetic: the same bits alone and among others,
    the model's numbers."""

    class ComplexRope(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(64, 64, bias=False)
            angles = torch.outer(torch.arange(128.0), 1e4 ** (-torch.arange(0, 8, 2) / 8))
            self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles))  # [positions, 4]

        def forward(self, x):  # x [B, S, 64]: 8 heads of 8
            b, s, _ = x.shape
            q = self.q(x).view(b, s, 8, 8).transpose(1, 2)
            q = torch.view_as_complex(q.reshape(b, 8, s, 4, 2).contiguous())  # [B, heads, S, 4]
            return torch.view_as_real(q * self.freqs[:s].view(1, 1, s, 4)).flatten(3)

    torch.manual_seed(0)
    model = ComplexRope().eval()
    compiled = compiler.compile(model, options=CompileOptions(invariant="batch", strict=True))
    with torch.no_grad():
        for n in (1, 5, 37):
            seq = torch.randn(n, 64)
            alone = compiled(seq[None])
            torch.testing.assert_close(alone, model(seq[None]))
            for b, s in ((2, 40), (3, 101)):
                x = torch.randn(b, s, 64)
                x[-1, :n] = seq
                got = compiled(x)[-1, :, :n]
                assert torch.equal(got, alone[0]), (n, b, s, (got != alone[0]).sum().item())
    swapped = [g.invariant["swapped"] for g in tpweave.report(compiled).graphs]
    assert all(s.get("complex mul on a CPU: in real arithmetic") == 1 for s in swapped), swapped


@pytest.mark.gpu(gpus=1)
def test_invariant_triton_kernels_give_a_row_the_same_bits_at_every_m_on_the_gpu():
    """ops/invariant_kernels.py compiled on the GPU (bf16, llama3-8b's shapes): a row's matmul result alone, among
    up to 2048 rows and at another place; a query's attention output in a prefill, a chunk after cached context, a
    decode, and packed among other sequences: bitwise the same. A down projection with its activation
    (invariant_gated_mm): a row's bits those of the activation's kernel then the product, alone and among 300. The
    "tp" level's tree product: a row alone and among 513, and the ranks' subtrees of a row-parallel K summed in the
    tree's upper levels at TP 2, 4 and 8: the bits of the whole tree."""
    from tpweave.ops import gemv, invariant_kernels
    from tpweave.ops.collectives import tree_sum

    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((6144, 4096), (4096, 14336), (28672, 4096)):
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
        x = torch.randn(2048, k, device="cuda", generator=g, dtype=torch.bfloat16)
        full = invariant_kernels.matmul(x, w.t())
        for m in (1, 7, 64, 65, 256, 513, 1000):
            assert torch.equal(invariant_kernels.matmul(x[:m], w.t()), full[:m]), (n, k, m)
            assert torch.equal(invariant_kernels.matmul(x[300 : 300 + m], w.t()), full[300 : 300 + m]), (n, k, m)
        for tiling in invariant_kernels.TILINGS:  # every launch shape, BLOCK_K 64 or 128: the same bits
            assert torch.equal(invariant_kernels.matmul(x[:65], w.t(), tiling=tiling), full[:65]), (n, k, tiling)
        torch.testing.assert_close(full.float(), (x @ w.t()).float(), atol=0.5, rtol=2e-2)
        if n == 4096:  # a SwiGLU MLP's down projection with its activation
            gu = torch.randn(300, 2 * k, device="cuda", generator=g, dtype=torch.bfloat16)
            want = invariant_kernels.matmul(gemv.silu_and_mul(gu), w.t())
            for rows in (slice(0, 1), slice(0, 2), slice(0, 16), slice(0, 17), slice(0, 64), slice(0, 300),
                         slice(5, 6), slice(100, 101)):  # fmt: skip
                assert torch.equal(torch.ops.tpweave.invariant_gated_mm(gu[rows], w.t()), want[rows]), rows
        # the "tp" level's tree product: rows alone, and the ranks' subtrees of a row-parallel K at TP 2, 4 and 8
        tree = invariant_kernels.tree_matmul(x[:513], w.t(), 8)
        torch.testing.assert_close(tree, (x[:513] @ w.t()).float(), atol=0.5, rtol=2e-2)
        for m in (1, 64, 65):
            assert torch.equal(invariant_kernels.tree_matmul(x[:m], w.t(), 8), tree[:m]), (n, k, m)
        for world in (2, 4, 8):
            kc = k // world
            parts = [invariant_kernels.tree_matmul(x[:513, r * kc : (r + 1) * kc], w.t()[r * kc : (r + 1) * kc],
                                                   8 // world) for r in range(world)]  # fmt: skip
            assert torch.equal(tree_sum(parts), tree), (n, k, world)
    _attention_bits_agree_on_the_gpu(launch=None)


def _attention_bits_agree_on_the_gpu(launch, prefill_launch=None) -> None:
    """A query's invariant attention output (bf16, llama3-8b's heads) in a prefill, a chunk after cached context, a
    decode and packed among others, per tile and per key chunk, every call under `launch` (None: the default plan),
    the whole prefill's under `prefill_launch` where given: bitwise the same."""
    prefill_launch = prefill_launch or launch
    from test_gpu_attention import _paged_case
    from tpweave.ops import invariant_kernels

    # one sequence of 300 tokens: prefilled whole / in chunks of 100 after cached context / its last 20 decoded
    args = _paged_case([300], [300], heads=32, kv_heads=8, head_dim=128, num_blocks=256)
    q, k_new, v_new, k_cache, v_cache, slots, cu, ctx, tables, bs, scale = args
    k_cache[slots], v_cache[slots] = k_new, v_new
    whole = invariant_kernels.attention(q, k_cache, v_cache, cu, context_lens=ctx, block_tables=tables,
                                        block_size=bs, scale=scale, launch=prefill_launch)  # fmt: skip
    for split in (False, True):  # one program per tile or per key chunk
        again = invariant_kernels.attention(q, k_cache, v_cache, cu, context_lens=ctx, block_tables=tables,
                                            block_size=bs, scale=scale, split=split,
                                            launch=launch)  # fmt: skip
        assert torch.equal(again, whole), split
    for start, end in [(0, 100), (100, 200), (200, 300)] + [(p, p + 1) for p in range(280, 300)]:
        part = invariant_kernels.attention(q[start:end], k_cache, v_cache, cu.new_tensor([0, end - start]),
                                           context_lens=ctx.new_tensor([end]), block_tables=tables, block_size=bs,
                                           scale=scale, launch=launch)  # fmt: skip
        assert torch.equal(part, whole[start:end]), (start, end)
    # the decodes packed with 63 other sequences' decodes and a chunk (the other sequences' blocks elsewhere)
    others = _paged_case([1] * 63 + [37], [900] * 63 + [600], heads=32, kv_heads=8, head_dim=128, num_blocks=4096,
                         seed=1)  # fmt: skip
    oq, _, _, ok_cache, ov_cache, _, ocu, octx, otables, _, _ = others
    ok_cache[: 256 * bs], ov_cache[: 256 * bs] = k_cache, v_cache  # this sequence's blocks, in the same pool
    otables = torch.nn.functional.pad(otables, (0, max(0, tables.shape[1] - otables.shape[1])))
    tab = torch.nn.functional.pad(tables, (0, otables.shape[1] - tables.shape[1]))
    mixed = invariant_kernels.attention(torch.cat([oq, q[299:300]]), ok_cache, ov_cache,
                                        torch.cat([ocu, ocu[-1:] + 1]), context_lens=torch.cat([octx, ctx]),
                                        block_tables=torch.cat([otables, tab]), block_size=bs, scale=scale,
                                        launch=launch)  # fmt: skip
    assert torch.equal(mixed[-1:], whole[299:300])


@pytest.mark.gpu(gpus=1)
def test_invariant_attention_gives_a_row_the_same_bits_under_every_plan_on_the_gpu():
    """Every call at 16, 32 or 128 rows a product (mma.sync below 64 rows, two warpgroups at 128), on 4 or 8 warps,
    one or four products a program, registers capped or not: a query's output the bits of the 64-row prefill's in a
    prefill, a chunk, a decode and packed among others (the exps' sums on the tensor cores; tl.sum's order would
    follow the rows and warps)."""
    from tpweave.ops.invariant_kernels import DECODE_REGISTERS, AttentionLaunch

    plans = (AttentionLaunch(rows=16), AttentionLaunch(rows=16, max_registers=DECODE_REGISTERS),
             AttentionLaunch(rows=16, num_warps=8), AttentionLaunch(rows=32), AttentionLaunch(rows=16, subtiles=4),
             AttentionLaunch(rows=128, num_warps=8))  # fmt: skip
    for plan in plans:
        _attention_bits_agree_on_the_gpu(launch=plan, prefill_launch=AttentionLaunch(rows=64))


@pytest.mark.gpu(gpus=1)
def test_tp_level_on_emulated_ranks_gives_tp_1s_bits_on_the_gpu():
    """invariant="tp" on the GPU in bf16 (the Triton tree product and attention): our Llama's logits alone and packed
    (plain, token-split and SP graphs) at TP 2 and 4, ranks emulated as processes sharing the GPU (gloo, the
    collectives through the host), bitwise those at TP 1."""
    import emulated_ranks
    import workers

    one = workers.tp_invariant_logits(TPContext.single("cuda"), "tp", torch.bfloat16)[0]
    for world in (2, 4):
        got, calls, _, _ = emulated_ranks.run(world, workers.tp_invariant_logits, "tp", torch.bfloat16,
                                              timeout_s=300, host_collectives=True)[0]  # fmt: skip
        assert calls == {"plain": 0, "split": 2, "sp": 1}, calls
        for (name, want), (_, logits) in zip(one, got, strict=True):
            assert torch.equal(logits, want), (world, name, (logits.float() - want.float()).abs().max())


@pytest.mark.gpu(gpus=2)
def test_tp_level_on_two_gpus_gives_tp_1s_bits():
    """invariant="tp" at TP 2 on two GPUs (NCCL: the ordered strategies' all-gathers, async TP's ops under
    `ordered_tp`): our Llama's logits in bf16 alone and packed (plain, token-split and SP graphs) bitwise those at
    TP 1 on one GPU. The emulated-rank test's case, with ranks of their own."""
    import workers

    one = workers.tp_invariant_logits(TPContext.single("cuda"), "tp", torch.bfloat16)[0]
    got, calls, _, _ = tpweave.launch(workers.tp_invariant_logits, "tp", torch.bfloat16, nprocs=2, timeout_s=300)[0]
    assert calls == {"plain": 0, "split": 2, "sp": 1}, calls
    for (name, want), (_, logits) in zip(one, got, strict=True):
        assert torch.equal(logits, want), (name, (logits.float() - want.float()).abs().max())


def test_an_input_that_would_run_eagerly_is_refused_not_answered():
    """Past Dynamo's recompile limit an input runs eagerly, without the invariant kernels: in invariant mode that call
    and every later one raise (naming the limit), where the default mode answers and notes it in the report."""

    class Branchy(torch.nn.Module):
        def forward(self, x, w):
            return (x @ w) * 2 if x.shape[0] > 3 else x @ w  # a guard on M: a new graph below 4 rows

    w = torch.randn(8, 8)
    for invariant in ("batch", None):
        torch._dynamo.reset()
        with torch._dynamo.config.patch(recompile_limit=1):
            compiled = compiler.compile(Branchy(), options=CompileOptions(invariant=invariant))
            big = torch.randn(6, 8)
            torch.testing.assert_close(compiled(big, w), Branchy()(big, w))
            small = torch.randn(2, 8)
            if invariant is None:
                torch.testing.assert_close(compiled(small, w), small @ w)
                assert any("recompile limit" in n for n in tpweave.report(compiled).notes)
                continue
            with pytest.raises(RuntimeError, match="invariant='batch': Dynamo reached its recompile limit"):
                compiled(small, w)
            with pytest.raises(RuntimeError, match="refuses every call from now on"):
                compiled(torch.randn(6, 8), w)  # a shape with a graph: refused too

    # a forward Dynamo cannot trace: the refusal names the cause, and raising the recompile limit is not the advice
    compiled = compiler.compile(Branchy(), options=CompileOptions(invariant="batch"))
    variant = compiled.variant_for(6)

    def untraceable(*args, **kwargs):
        raise torch._dynamo.exc.TorchDynamoException("a reason Dynamo gives")

    compiled.variants[variant] = untraceable
    with pytest.raises(RuntimeError, match="failed to trace this model") as refused:
        compiled(torch.randn(6, 8), w)
    assert "(TorchDynamoException: a reason Dynamo gives)" in str(refused.value), refused.value
    assert "needs a forward Dynamo can trace" in str(refused.value) and "recompile_limit" not in str(refused.value)


def test_a_graph_inductor_fails_on_after_the_passes_is_refused_in_invariant_mode(monkeypatch):
    """Where Inductor fails on a graph after tpweave's passes, the default mode compiles it without them (a note);
    in invariant mode that graph would have none of the invariant kernels: the call raises, naming the failure."""
    from tpweave.compiler import tp_pass

    compile_fx = tp_pass.TPBackend._compile

    def failing(self, gm, example_inputs, passes):
        if passes is not None:
            raise RuntimeError("a lowering that broke")
        return compile_fx(self, gm, example_inputs, passes)

    monkeypatch.setattr(tp_pass.TPBackend, "_compile", failing)
    w, x = torch.randn(8, 8), torch.randn(5, 8)
    for invariant in (None, "batch"):
        torch._dynamo.reset()
        compiled = compiler.compile(_MatMul(), options=CompileOptions(invariant=invariant))
        if invariant is None:
            torch.testing.assert_close(compiled(x, w), x @ w)
            assert any("compiling without our passes" in n for g in tpweave.report(compiled).graphs for n in g.notes)
            continue
        with pytest.raises(RuntimeError, match="could not be compiled with tpweave's passes") as refused:
            compiled(x, w)
        assert "RuntimeError: a lowering that broke" in str(refused.value), refused.value
        notes = [n for g in tpweave.report(compiled).graphs for n in g.notes]
        assert any("refused" in n for n in notes) and not any("without our passes" in n for n in notes), notes


def test_dynamo_restarting_its_analysis_in_the_backend_is_no_failure(monkeypatch):
    """Dynamo may restart a frame's analysis from inside the backend (TensorifyScalarRestartAnalysis: a Python float
    automatic dynamic made an input, specialized after all; seen building a second engine in one process): Dynamo
    traces again and calls the backend anew. That is no failure of the passes: invariant mode does not refuse the
    model, and the report counts the one graph compiled."""
    from tpweave.compiler import tp_pass

    compile_fx = tp_pass.TPBackend._compile
    calls = []

    def restarting_once(self, gm, example_inputs, passes):
        calls.append(1)
        if len(calls) == 1:
            raise torch._dynamo.exc.TensorifyScalarRestartAnalysis
        return compile_fx(self, gm, example_inputs, passes)

    monkeypatch.setattr(tp_pass.TPBackend, "_compile", restarting_once)
    torch._dynamo.reset()
    w, x = torch.randn(8, 8), torch.randn(5, 8)
    compiled = compiler.compile(_MatMul(), options=CompileOptions(invariant="batch"))
    torch.testing.assert_close(compiled(x, w), x @ w)
    report = tpweave.report(compiled)
    assert len(calls) == 2 and report.num_compiles == len(report.graphs) == 1, (calls, report.num_compiles)
    assert not [n for g in report.graphs for n in g.notes], report.graphs[0].notes


class _MatMul(torch.nn.Module):
    def forward(self, x, w):
        return x @ w


def test_async_tp_ops_under_the_ordered_strategies_give_the_unfused_ops_bits_and_overlap():
    """ops/strategies/ordered.py at TP 4 (gloo; at TP 2 any order of a sum gives the same bits), M from 1 (a rank's
    shard all padding) to 129: `ordered`'s and `ordered_tp`'s gather + matmul (with and without a bias) and matmul +
    scatter bitwise the unfused ops they stand for (the gather then the level's matmul; the matmul then the ordered
    reduce-scatter, or at level "tp" the row-parallel product and scatter as one op); and each multiplies this rank's
    own rows while its collective is in flight."""
    import workers

    for equal, orders in tpweave.launch(workers.ordered_strategy_outputs, [1, 3, 64, 129], nprocs=4, timeout_s=300):
        assert len(equal) == 16 and all(equal.values()), equal
        for (name, kind), events in orders.items():
            assert events.count("start") == events.count("wait") == 1, (name, kind, events)
            start, wait = events.index("start"), events.index("wait")
            # a product under the collective (this rank's rows), another outside it (the other ranks' rows)
            assert "mm" in events[start:wait] and "mm" in events[:start] + events[wait:], (name, kind, events)


@pytest.mark.gpu(gpus=1)
@pytest.mark.parametrize("warp_specialized", [False, True])  # last in this file: a hang there loses only them
def test_invariant_matmul_through_the_tma_gives_the_pointer_kernels_bits_on_the_gpu(warp_specialized):
    """The matmul's TMA candidates (invariant_kernels.TMA_TILINGS: one tile a program, persistent, and Triton's warp
    specialization, new on Hopper, apart; the same warpgroup MMA steps over K in order): a row's bits those of the
    default launch at 1, 65 and 2048 rows, the weight transposed and (K, N), so any of them can be picked per M
    without changing a row."""
    from tpweave.ops import invariant_kernels

    tilings = [t for t in invariant_kernels.TMA_TILINGS if t.warp_specialize == warp_specialized]
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((6144, 4096), (4096, 14336)):
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
        x = torch.randn(2048, k, device="cuda", generator=g, dtype=torch.bfloat16)
        full = invariant_kernels.matmul(x, w.t())
        for tiling in tilings:
            for m in (1, 65, 2048):
                assert torch.equal(invariant_kernels.matmul(x[:m], w.t(), tiling=tiling), full[:m]), (n, k, m, tiling)
        w_kn = w.t().contiguous()
        for tiling in tilings[:2]:
            assert torch.equal(invariant_kernels.matmul(x[:65], w_kn, tiling=tiling), full[:65]), (n, k, tiling)
