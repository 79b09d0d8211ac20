"""Compiler passes through the real Inductor backend on gloo ranks: graph before/after and numbers
against eager TP and the unsharded (TP=1) model, for every token count. Graphs: one for every M >= 2
(2 <= M <= TP included: shards have at least 2 rows, ops/collectives.py `shard_rows`), one for M = 1
(a size-1 dim stays static: see compiler/dynamic.py)."""

import pytest
import torch

import tpweave
import workers
from conftest import num_gpus
from tpweave.models import get_preset

GPU_RANKS = min(2, num_gpus())  # TP=2 on the 2-GPU box; one rank (SP forced) where only one GPU is lent

TOKEN_COUNTS = [1, 2, 3, 5, 64, 129, 1000]
TOL = {"float32": 1e-4, "bfloat16": 6e-2}
NUM_LAYERS = get_preset("tiny").num_layers
MAX_GRAPHS = 3  # per variant, for token counts that include 1, 2 and larger M (see the module docstring)


@pytest.fixture(scope="module")
def reference_logits():
    return workers.eager_logits(tpweave.TPContext.single(), "tiny", TOKEN_COUNTS, ("float32", "bfloat16"))


def _close(a, b, dtype):
    return (a - b).abs().max().item() <= TOL[dtype] * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_llama_sp_async_tp_equals_eager_and_single_rank(tp, reference_logits):
    dtypes = ("float32", "bfloat16") if tp == 2 else ("float32",)  # bf16's tolerances at one TP (CI's 2 cores)
    results = tpweave.launch(workers.llama_compiled_outputs, "tiny", TOKEN_COUNTS, dtypes, nprocs=tp)
    for rank_out in results:
        for dtype in dtypes:
            assert 1 <= rank_out[(dtype, "num_compiles")] <= MAX_GRAPHS, rank_out[(dtype, "report")]
            for variant, before, after, sites in rank_out[(dtype, "graphs")]:
                assert variant == "sp"
                # embedding + 2 per layer all-reduces, and the LM head's logits gather
                assert before == {"all_reduce": 2 * NUM_LAYERS + 1, "all_gather_into_tensor": 1}
                assert "all_reduce" not in after and "all_gather_tokens" not in after
                assert after["mm_rs"] == 2 * NUM_LAYERS  # o_proj and down_proj
                assert after["reduce_scatter_tokens"] == 1  # the vocab-parallel embedding (no matmul)
                assert after["ag_mm"] == 2 * NUM_LAYERS + 1  # qkv, gate_up per layer + the LM head
                assert sum(1 for s in sites if s[:2] == ("all_reduce", "sequence-parallel")) == 2 * NUM_LAYERS + 1
            for m in TOKEN_COUNTS:
                compiled, eager = rank_out[(dtype, m, "compiled")], rank_out[(dtype, m, "eager")]
                assert compiled.shape == eager.shape == reference_logits[(dtype, m)].shape
                assert _close(compiled, eager, dtype), (tp, dtype, m)
                assert _close(compiled, reference_logits[(dtype, m)], dtype), (tp, dtype, m)


FOREIGN_SHAPES = [(2, 3), (3, 7), (1, 5), (2, 64), (1, 1)]  # (batch, seq): 6, 21, 5, 128, 1 tokens


@pytest.fixture(scope="module")
def foreign_reference():
    refs = {}
    for norm in ("hand", "fused", "layernorm"):
        refs[norm] = tpweave.launch(workers.foreign_model_outputs, FOREIGN_SHAPES, norm=norm, nprocs=1)[0]["eager"]
    refs["unknown"] = tpweave.launch(workers.foreign_model_outputs, FOREIGN_SHAPES, unknown_op=True, nprocs=1)[0][
        "eager"
    ]
    return refs


def _check_foreign(results, reference):
    for rank_out in results:
        for compiled, eager, ref in zip(rank_out["compiled"], rank_out["eager"], reference):
            torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(compiled, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("norm,tp", [("hand", 3), ("fused", 2), ("layernorm", 4)])
def test_foreign_style_model(norm, tp, foreign_reference):
    """3-D activations, dist.all_reduce, hand-written/fused/layer norms, biases, replicated embedding."""
    results = tpweave.launch(workers.foreign_model_outputs, FOREIGN_SHAPES, {"sp_min_tokens": 0}, norm=norm, nprocs=tp)
    _check_foreign(results, foreign_reference[norm])
    out = results[0]
    # The first graph serves every shape with batch and seq > 1; batch = 1 and batch = seq = 1 get their own.
    assert 1 <= out["num_compiles"] <= 3, out["report"]
    variant, before, after, sites, notes = out["graphs"][0]
    assert before == {"all_reduce": 4}
    assert after == {"ag_mm": 4, "mm_rs": 4}, out["report"]
    assert ("replicated->shard", "sliced locally") in [s[:2] for s in sites]  # embedding meets the first shard
    fused = [s for s in sites if s[0] == "all_gather+matmul"]
    assert any("over 3 matmul(s)" in s[2] for s in fused)  # q, k, v share one gather
    assert any("over 2 matmul(s)" in s[2] for s in fused)  # gate, up share one gather


def test_unknown_op_gathers_first_and_still_matches(foreign_reference):
    results = tpweave.launch(
        workers.foreign_model_outputs, FOREIGN_SHAPES, {"sp_min_tokens": 0}, unknown_op=True, nprocs=2
    )
    _check_foreign(results, foreign_reference["unknown"])
    variant, before, after, sites, notes = results[0]["graphs"][0]
    assert "all_reduce" not in after
    assert any("unknown op aten::cumsum" in n for n in notes), notes
    assert any(s[0] == "all_gather" and "unknown op aten::cumsum" in s[2] for s in sites)


def test_residual_copied_into_streams_stays_sequence_parallel():
    """Hyper-connection style residual: x.unsqueeze(2).expand(-1, -1, n, -1) mixed by per-stream weights and by
    per-token ones from a replicated linear over the flattened streams. The expand of a feature dim is token-wise,
    and so is the linear's view of the tokens to one dim and back, one token included (the (1, 1) graph: [1, X] to
    [1, 1, N] keeps the model's two token dims): no gather before them, numbers equal eager TP and TP=1. The stream
    linear's product only weighs the sharded streams, so it runs on this rank's tokens: no gather of the n * H
    flattened streams either."""
    reference = tpweave.launch(workers.foreign_model_outputs, FOREIGN_SHAPES, num_streams=3, nprocs=1)[0]["eager"]
    results = tpweave.launch(
        workers.foreign_model_outputs, FOREIGN_SHAPES, {"sp_min_tokens": 0}, num_streams=3, nprocs=2
    )
    _check_foreign(results, reference)
    for _variant, before, after, _sites, notes in results[0]["graphs"]:
        assert before == {"all_reduce": 4}
        # the gathers before the column-parallel products after the first all-reduce and the head's; none for a stream
        # linear
        assert after == {"ag_mm": 4, "mm_rs": 4}, results[0]["report"]
        # the second block's stream linear (the first one's reads the embeddings, replicated)
        assert [s[:2] for s in _sites if s[0] == "matmul"] == [("matmul", "sequence-parallel")], _sites
        assert not any("expand" in n or "gathered first" in n for n in notes), notes


def test_moe_model_with_flattened_tokens_and_a_token_shift():
    """Mixtral-style MoE blocks (view(-1, hidden) with a symbolic -1, replicated router, sharded experts,
    sort by expert) with a token shift over each sequence: the flattening view stays sequence-parallel
    (it used to gather first), the shift gathers (batch, seq) tokens, the router's matmul gathers through
    the same all-gather. Numbers equal eager TP and TP=1."""
    reference = tpweave.launch(workers.foreign_model_outputs, FOREIGN_SHAPES, model_name="MoEModel", nprocs=1)[0][
        "eager"
    ]
    results = tpweave.launch(
        workers.foreign_model_outputs, FOREIGN_SHAPES, {"sp_min_tokens": 0}, model_name="MoEModel", nprocs=2
    )
    _check_foreign(results, reference)
    variant, before, after, sites, notes = results[0]["graphs"][0]
    assert before == {"all_reduce": 2} and "all_reduce" not in after, results[0]["report"]
    assert not any("passes failed" in n or "view with" in n for n in notes), notes
    assert any("unknown op aten::constant_pad_nd" in n for n in notes), notes
    fused = [s for s in sites if s[0] == "all_gather+matmul"]
    assert len(fused) == 2, results[0]["report"]  # layer 2's router (its gather shared with the shift) and the head


def test_fused_gather_matmul_keeps_earlier_readers_in_order():
    """An op that reads the gathered tokens before their matmul (as a kept view does, Hugging Face's
    Mixtral before the view rule) moves after the fused ag_mm that now provides them; same numbers."""
    for before, after, ops in tpweave.launch(workers.gather_read_before_its_matmul, nprocs=2):
        assert ops.index("tpweave.ag_mm.default") < ops.index("aten.roll.default") and "aten.mm.default" not in ops, ops
        for got, want in zip(after, before):
            torch.testing.assert_close(got, want)


def test_average_all_reduce_is_left_alone():
    shapes = FOREIGN_SHAPES[:3]
    results = tpweave.launch(workers.foreign_model_outputs, shapes, {"sp_min_tokens": 0}, reduce_op="avg", nprocs=2)
    for compiled, eager in zip(results[0]["compiled"], results[0]["eager"]):
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    variant, before, after, sites, notes = results[0]["graphs"][0]
    assert after == before == {"all_reduce": 4}
    assert [s for s in sites if s[0] == "all_reduce"] == [
        ("all_reduce", "left alone", "reduce op 'avg' is not a sum")
    ] * 4


def test_pass_failure_falls_back_to_plain_compile(foreign_reference):
    shapes = FOREIGN_SHAPES[:2]
    results = tpweave.launch(workers.foreign_model_outputs, shapes, {"sp_min_tokens": 0}, fail_pass=True, nprocs=2)
    _check_foreign(results, foreign_reference["hand"][:2])
    variant, before, after, sites, notes = results[0]["graphs"][0]
    assert any("passes failed (RuntimeError: injected pass failure); compiled without them" in n for n in notes)
    assert after == before and not sites  # the report shows the graph as compiled: untouched


def test_pass_failure_raises_under_strict():
    """strict=True (what the other tests compile with): a failure inside tpweave's passes raises."""
    kwargs = {"sp_min_tokens": 0, "strict": True}
    with pytest.raises(tpweave.WorkerError, match="tpweave's passes failed: RuntimeError: injected pass failure"):
        tpweave.launch(workers.foreign_model_outputs, FOREIGN_SHAPES[:1], kwargs, fail_pass=True, nprocs=2)


def test_batch_seq_model_graphs_and_inductor_failure_fallbacks():
    """(batch, seq) MLPs of `x @ w.t()` with an in-place all-reduce, at every size-1 pattern of (batch,
    seq): one graph each, the same at TP=1, plain TP=2 (the all-reduce applied to the flattened token
    dims) and SP. A graph Inductor cannot compile is compiled without our passes, then run uncompiled
    with a note, never a crash."""
    shapes = [(3, 5), (1, 1), (2, 1), (1, 7), (4, 2)]
    reference = tpweave.launch(workers.foreign_model_outputs, shapes, model_name="MatmulMLPModel", nprocs=1)[0]["eager"]
    for nprocs, kwargs in ((1, {}), (2, {"sp": False}), (2, {"sp_min_tokens": 0})):
        results = tpweave.launch(
            workers.foreign_model_outputs, shapes, kwargs, model_name="MatmulMLPModel", nprocs=nprocs
        )
        _check_foreign(results, reference)
        assert results[0]["num_compiles"] == 4, (nprocs, kwargs, results[0]["report"])  # (4, 2) reuses (3, 5)'s
        for variant, before, after, sites, notes in results[0]["graphs"]:
            assert not notes, notes
            if variant == "plain":
                assert after == before == {"all_reduce": 2}
                assert all(why.endswith("token dims flattened") for kind, _, why in sites if kind == "all_reduce"), (
                    sites
                )
    results = tpweave.launch(
        workers.foreign_model_outputs, shapes[:2], {"sp_min_tokens": 0}, fail_inductor=True, nprocs=2
    )
    _check_foreign(results, tpweave.launch(workers.foreign_model_outputs, shapes[:2], nprocs=1)[0]["eager"])
    notes = results[0]["graphs"][0][4]
    assert [n.split(" (")[0] + " ..." + n.split(";")[-1] for n in notes] == [
        "Inductor failed ... compiling without our passes",
        "Inductor failed without our passes too ... running this graph uncompiled",
    ], notes


ONE_ROW_SHAPES = [(1, 64), (1, 65), (1, 2), (1, 3), (1, 5), (1, 129), (1, 1)]  # (batch, seq), in this order


@pytest.mark.parametrize("tp", [2, 3])
def test_one_graph_where_token_shards_have_one_row(tp):
    """seq (or M) = 2..TP has ceil(M/TP) = 1 token per shard: shards are padded to 2 rows
    (ops/collectives.py `shard_rows`), so no meta function or lowering guards on a one-row shard and
    the first graph serves every M >= 2; M = 1 gets its own (at TP 3, M = 2 leaves a rank no token). A (batch, seq)
    model and our packed model (token ids of shape (M,)); compiled logits equal the uncompiled model's at every
    shape."""
    counts = [s * b for b, s in ONE_ROW_SHAPES]
    for model_name, shapes in (("ForeignModel", ONE_ROW_SHAPES), ("tiny", counts)):
        for rank_out in tpweave.launch(workers.graphs_per_call, model_name, shapes, nprocs=tp):
            assert not rank_out["notes"], rank_out["report"]
            assert rank_out["new_graphs"] == [1, 0, 0, 0, 0, 0, 1], (model_name, tp, rank_out["report"])
            for shape, got, want in zip(shapes, rank_out["compiled"], rank_out["eager"]):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{model_name} {shape}: {m}")


def test_tp_subgroup_of_a_larger_world(reference_logits):
    """4 ranks = 2 data-parallel replicas x TP=2 groups: each replica compiles on its own TP group and
    equals eager TP and TP=1."""
    counts = [1, 5, 64]
    results = tpweave.launch(workers.tp_subgroup_outputs, counts, 2, nprocs=4)
    for outs, after in results:
        assert after.get("ag_mm") and after.get("mm_rs") and "all_reduce" not in after, after
        for m, (compiled, eager) in zip(counts, outs):
            assert _close(compiled, eager, "float32") and _close(
                compiled, reference_logits[("float32", m)], "float32"
            ), m


def test_model_dynamo_cannot_trace_runs_eagerly_with_a_note():
    counts = [1, 6]
    reference = tpweave.launch(workers.style_outputs, ["plain"], counts, False, nprocs=1)[0]["plain"][0]
    out = tpweave.launch(workers.style_outputs, ["async_op"], counts, nprocs=2)[0]["async_op"]
    eager, compiled, (num_compiles, graphs, text, sites) = out
    for got, want in zip(compiled, reference):
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    if num_compiles == 0:  # what torch 2.13 does with async_op=True: the report must say so
        assert "torch.compile traced no graph of this model: it runs eagerly" in text, text


def test_sp_and_plain_graphs_chosen_by_token_count(reference_logits):
    counts = [1, 5, 64, 129]
    results = tpweave.launch(
        workers.llama_compiled_outputs, "tiny", counts, ("float32",), {"sp_min_tokens": 64}, nprocs=2
    )
    out = results[0]
    # plain graphs for M = 1 and M = 5 (M < 64), one SP graph (M >= 64)
    assert [g[0] for g in out[("float32", "graphs")]] == ["plain", "plain", "sp"]
    assert out[("float32", "serves")] == ["M = 1", "M = 2..63", "M >= 64"]  # in the report, beside each graph
    assert "[plain] serves M = 2..63;" in out[("float32", "report")]
    plain_after = out[("float32", "graphs")][0][2]
    assert plain_after == {"all_reduce": 2 * NUM_LAYERS + 1, "all_gather_into_tensor": 1}
    for m in counts:
        assert _close(out[("float32", m, "compiled")], reference_logits[("float32", m)], "float32")


def test_debug_log_prints_graphs(capfd, monkeypatch):
    monkeypatch.setenv("TPWEAVE_LOG", "debug")
    tpweave.launch(workers.foreign_model_outputs, [(2, 3)], {"sp_min_tokens": 0}, nprocs=2)
    err = capfd.readouterr().err
    assert "graph before passes" in err and "graph after sequence_parallel" in err and "graph after async_tp" in err
    assert "tpweave.reduce_scatter_tokens" in err
    # nothing reads the gathered activations besides the matmuls: the op is told it need not keep them
    fused_gathers = [line for line in err.splitlines() if "tpweave.ag_mm.default](args" in line]
    assert fused_gathers and all(line.rstrip().endswith("False), kwargs = {})") for line in fused_gathers)


def test_bad_input_errors():
    # one process without a process group compiles as TP=1 (the engine compiles its model at every TP)
    linear = torch.nn.Linear(2, 2)
    x = torch.randn(3, 2)
    torch.testing.assert_close(tpweave.compile(linear)(x), linear(x))
    with pytest.raises(ValueError, match="no process group is initialized"):
        tpweave.compile(linear, group="tp")
    for bad in (-1, 2000, 1.5, True):
        with pytest.raises(ValueError, match="token_split_sms must be an integer in"):
            tpweave.compile(linear, token_split_sms=bad)
    messages = tpweave.launch(workers.compile_errors, nprocs=2)[0]
    assert "empty batch" in messages["empty"]
    assert "sp_min_tokens must be >= 0" in messages["negative"]
    assert (
        messages["disagree"].startswith("ranks disagree on tpweave.compile options")
        and "'sp_min_tokens'" in messages["disagree"]
    )


@pytest.mark.gpu(gpus=1)
@pytest.mark.parametrize("cudagraphs", [False, True])
def test_gpu_llama3_8b_sp_async_tp_matches_plain(cudagraphs):
    """llama3-8b preset (2 layers to keep it short), TP=2, bf16: SP + async TP vs the plain TP graph."""
    counts = [1, 7, 512, 4096]
    out = tpweave.launch(workers.gpu_sp_vs_plain, "llama3-8b", counts, cudagraphs, nprocs=GPU_RANKS, backend="nccl")
    for rank_out in out:
        assert rank_out["num_compiles_sp"] == 2 and rank_out["num_compiles_plain"] == 2  # M = 1 and every other M
        for m in counts:
            sp, plain = rank_out[("sp", m)], rank_out[("plain", m)]
            scale = plain.abs().max().item()
            print(
                f"cudagraphs={cudagraphs} M={m}: max|SP+asyncTP - plain| = {(sp - plain).abs().max().item():.4g} "
                f"(max|logit| {scale:.3g})"
            )
            assert (sp - plain).abs().max().item() <= 3e-2 * max(1.0, scale), (
                m,
                (sp - plain).abs().max().item(),
                scale,
            )


def test_other_model_styles():
    """Post-norm, parallel attention+MLP (one all-reduce of a sum), Gemma-like (1 + w) fp32 norm with a
    scaled embedding, vLLM-style fused residual with a last-token head and two outputs, funcol all_reduce."""
    from style_models import STYLES

    counts = [1, 2, 5, 33]
    reference = tpweave.launch(workers.style_outputs, STYLES, counts, False, nprocs=1)[0]
    results = tpweave.launch(workers.style_outputs, STYLES, counts, nprocs=3)
    for rank_out in results:
        for style in STYLES:
            eager, compiled, (num_compiles, graphs, text, _) = rank_out[style]
            assert 1 <= num_compiles <= MAX_GRAPHS, (style, text)
            for before, after, _ in graphs:
                assert "all_reduce" not in after and before["all_reduce"] == after.get("mm_rs", 0) + after.get(
                    "reduce_scatter_tokens", 0
                )
            for got_outs, eager_outs, ref_outs in zip(compiled, eager, reference[style][0]):
                for got, want, ref in zip(got_outs, eager_outs, ref_outs):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=style)
                    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=style)


FUSED_NORM = {"sp": False, "all_reduce_rms_norm_policy": "triton_ar_norm"}  # the composed path on CPU


def test_plain_graph_fuses_all_reduce_residual_rms_norm(reference_logits):
    """Plain TP graph: every all-reduce of the tiny Llama (embedding, o_proj, down_proj) and the add +
    RMSNorm after it become one tpweave::all_reduce_rms_norm; logits equal eager TP and TP=1."""
    counts = [1, 3, 64, 129]
    results = tpweave.launch(
        workers.llama_compiled_outputs, "tiny", counts, ("float32", "bfloat16"), FUSED_NORM, nprocs=2
    )
    for rank_out in results:
        for dtype in ("float32", "bfloat16"):
            assert 1 <= rank_out[(dtype, "num_compiles")] <= MAX_GRAPHS
            # what kernel verification expects: the fused op's policy, not the (now absent) all-reduce's
            assert rank_out[(dtype, "strategies_at_1")] == ["triton_ar_norm"]
            for variant, before, after, sites in rank_out[(dtype, "graphs")]:
                assert variant == "plain" and before["all_reduce"] == 2 * NUM_LAYERS + 1
                assert after == {"all_reduce_rms_norm": 2 * NUM_LAYERS + 1, "all_gather_into_tensor": 1}
                fused = [s for s in sites if s[:2] == ("all_reduce_rms_norm", "fused")]
                assert len(fused) == 2 * NUM_LAYERS + 1
                assert sum("residual add" in s[2] for s in fused) == 2 * NUM_LAYERS  # the embedding's has no residual
            order = "weight in fp32" if dtype == "float32" else "weight after the cast"
            assert all(order in s[2] for s in fused)
            for m in counts:
                got = rank_out[(dtype, m, "compiled")]
                assert _close(got, rank_out[(dtype, m, "eager")], dtype), (dtype, m)
                assert _close(got, reference_logits[(dtype, m)], dtype), (dtype, m)


def test_all_reduce_norm_fusion_across_styles():
    """Which styles fuse (RMSNorm in the Llama, Gemma (1 + w) and F.rms_norm forms, with or without a
    residual add) and which are left alone with a reason (LayerNorm); numbers equal eager TP and TP=1."""
    from style_models import STYLES

    counts = [1, 5, 33]
    reference = tpweave.launch(workers.style_outputs, STYLES, counts, False, nprocs=1)[0]
    results = tpweave.launch(workers.style_outputs, STYLES, counts, True, FUSED_NORM, nprocs=2)
    expect_fused = {"postnorm": 0, "parallel": 1, "gemma": 2, "fused_residual": 2, "funcol": 2, "row_bias": 0}
    for rank_out in results:
        for style in STYLES:
            eager, compiled, (num_compiles, graphs, text, _) = rank_out[style]
            assert 1 <= num_compiles <= MAX_GRAPHS, text
            for before, after, sites in graphs:
                norm_sites = [s for s in sites if s[0] == "all_reduce_rms_norm"]
                assert sum(s[1] == "fused" for s in norm_sites) == expect_fused[style], (style, text)
                assert after.get("all_reduce_rms_norm", 0) == expect_fused[style]
                assert after.get("all_reduce", 0) == before["all_reduce"] - expect_fused[style]
                if style == "postnorm":
                    assert all(s[1:] == ("left alone", "no RMSNorm reads it") for s in norm_sites), text
            for got_outs, eager_outs, ref_outs in zip(compiled, eager, reference[style][0]):
                for got, want, ref in zip(got_outs, eager_outs, ref_outs):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=style)
                    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=style)


def test_dtensor_parallelized_model():
    """A model written for one device and sharded with torch's parallelize_module (DTensor redistributes,
    not hand-written collectives): the SP graph turns its all-reduces into reduce-scatter + matmul ops and
    matches the eager DTensor model and the unsharded one at every M."""
    shapes = [(1, 1), (2, 3), (1, 7), (3, 16)]
    ref = tpweave.launch(workers.dtensor_model_outputs, shapes, {}, nprocs=1)[0]["eager"]
    for rank_out in tpweave.launch(workers.dtensor_model_outputs, shapes, {"sp_min_tokens": 0}, nprocs=2):
        # (1, 1); (1, 7); (2, 3) and (3, 16) apart: DTensor's view sharding guards batch % TP == 0
        assert 1 <= rank_out["num_compiles"] <= 4, rank_out["graphs"]
        for variant, before, after in rank_out["graphs"]:
            assert variant == "sp" and before.get("all_reduce") == 2 and "all_reduce" not in after
            assert after.get("mm_rs") == 2 and after.get("ag_mm") == 2  # down_proj; gate + up share one gather
        for compiled, eager, want in zip(rank_out["compiled"], rank_out["eager"], ref):
            torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(compiled, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_hf_transformers_model_with_torch_tp_plan(arch):
    """Third-party models as users have them: Hugging Face's Llama and Gemma-2 (sandwich norms, 1 + w
    RMSNorm, logit soft-capping), sharded with torch's parallelize_module, called with keyword arguments.
    Llama's SDPA attention breaks the graph under dynamic sequence lengths (is_causal becomes a SymBool),
    so the SP passes rewrite the segments between attentions. Gemma-2 (eager attention): torch 2.13's
    DTensor cannot propagate the row-parallel o_proj's sharding under dynamic shapes, Dynamo fails, and
    the model must run eagerly with a report note instead of crashing. Logits equal the unsharded model's."""
    pytest.importorskip("transformers")
    shapes = [(1, 1), (2, 3), (3, 16)]
    for rank_out in tpweave.launch(workers.hf_model_outputs, arch, shapes, nprocs=2, timeout_s=900):
        rewritten = [after for variant, before, after in rank_out["graphs"] if before.get("all_reduce")]
        assert all("all_reduce" not in after and after.get("mm_rs") for after in rewritten), rank_out["graphs"]
        traced = not any("failed to trace" in note for note in rank_out["notes"])
        assert rewritten if traced else not rewritten, (rank_out["graphs"], rank_out["notes"])
        if arch == "llama":
            assert rewritten and traced
        for got, want in zip(rank_out["got"], rank_out["want"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["mixtral", "phi3"])
def test_hf_model_with_its_own_tp_plan(arch, tmp_path):
    """Hugging Face models loaded the way their users run TP: a safetensors checkpoint and
    from_pretrained(tp_plan="auto") (transformers' own sharding hooks, no DTensor). Mixtral: MoE blocks
    (flattened tokens, router, experts, index_add); Phi-3: packed qkv and gate_up projections. Every
    all-reduce becomes sequence-parallel, the passes never fall back, logits equal the unsharded model."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it for tp_plan
    shapes = [(1, 1), (2, 3), (1, 9), (3, 16)]
    for rank_out in tpweave.launch(
        workers.hf_tp_plan_outputs, arch, shapes, str(tmp_path / arch), nprocs=2, timeout_s=900
    ):
        assert not any("failed" in n for n in rank_out["notes"]), rank_out["report"]
        # transformers 5.17 loops over the experts a batch hits: graph breaks, some graphs without collectives
        rewritten = [after for variant, before, after in rank_out["graphs"] if before.get("all_reduce")]
        assert rewritten and all("all_reduce" not in after for after in rewritten), rank_out["report"]
        assert any(a.get("ag_mm") for a in rewritten) and any(a.get("mm_rs") for a in rewritten), rank_out["report"]
        for got, want in zip(rank_out["got"], rank_out["want"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_hf_generate_runs_tpweave_graphs_for_prefill_and_decode(tmp_path):
    """model.forward = tpweave.compile(model.forward) on an HF Llama sharded by its own tp_plan:
    model.generate (prefill + decode through HF's KV cache) gives the unsharded model's greedy tokens,
    and the prefill graph is sequence-parallel (its all-reduces became ag_mm / mm_rs)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    prompts = [[5, 17, 42, 7, 99, 3, 11], [8, 1, 64]]
    for rank_out in tpweave.launch(
        workers.hf_generate_with_compiled_forward, str(tmp_path / "llama"), prompts, 6, nprocs=2, timeout_s=900
    ):
        for got, want in rank_out["tokens"]:
            assert got == want and len(got) > 6, rank_out["report"]
        sp_graphs = [after for variant, before, after in rank_out["graphs"] if before.get("all_reduce")]
        assert sp_graphs and all("all_reduce" not in after for after in sp_graphs), rank_out["report"]
        assert any(after.get("ag_mm") and after.get("mm_rs") for after in sp_graphs), rank_out["report"]
        assert not any("failed" in n for n in rank_out["notes"]), rank_out["report"]


def test_size_one_token_dims_get_a_graph_of_their_own(tmp_path):
    """seq = 1 after a graph for seq >= 2 (decode after prefill), then batch = seq = 1. Dynamo's
    size-oblivious mode would run these on the seq >= 2 graph, and Inductor then computes wrong logits
    for gpt_oss (attention sinks, sliding window, MoE experts): tpweave compiles size-1 dims apart.
    Logits equal the unsharded model at every shape; graphs: one per size-1 pattern, no more."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    shapes = [(2, 3), (3, 1), (1, 1), (4, 5), (1, 7)]
    for rank_out in tpweave.launch(
        workers.hf_tp_plan_outputs, "gpt_oss", shapes, str(tmp_path / "gpt_oss"), nprocs=2, timeout_s=900
    ):
        assert not any("failed" in n for n in rank_out["notes"]), rank_out["report"]
        assert len(rank_out["graphs"]) <= 4, rank_out[
            "report"
        ]  # (B, S), (B, 1), (1, 1), (1, S); (4, 5) reuses the first
        for got, want in zip(rank_out["got"], rank_out["want"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


SP_FUSED_NORM = {"sp_min_tokens": 0, "mm_rs_policy": "ce_overlap"}  # on CPU: sequential + the reference add + norm


def test_sp_graph_fuses_reduce_scatter_residual_rms_norm(reference_logits):
    """SP graph: with a matmul + reduce-scatter strategy that finishes its reduction in the norm kernel,
    each o_proj / down_proj mm_rs and the residual add + RMSNorm after it become one
    tpweave::mm_rs_rms_norm (TP=3: uneven shards); logits equal eager TP and TP=1."""
    counts = [1, 2, 5, 129]
    results = tpweave.launch(
        workers.llama_compiled_outputs, "tiny", counts, ("float32", "bfloat16"), SP_FUSED_NORM, nprocs=3
    )
    for rank_out in results:
        for dtype in ("float32", "bfloat16"):
            assert 1 <= rank_out[(dtype, "num_compiles")] <= MAX_GRAPHS
            for variant, _before, after, sites in rank_out[(dtype, "graphs")]:
                assert variant == "sp" and after.get("mm_rs_rms_norm") == 2 * NUM_LAYERS and "mm_rs" not in after
                fused = [s for s in sites if s[:2] == ("mm_rs_rms_norm", "fused")]
                assert len(fused) == 2 * NUM_LAYERS and all("residual add + RMSNorm" in s[2] for s in fused)
            for m in counts:
                got = rank_out[(dtype, m, "compiled")]
                assert _close(got, rank_out[(dtype, m, "eager")], dtype), (dtype, m)
                assert _close(got, reference_logits[(dtype, m)], dtype), (dtype, m)


def test_reduce_scatter_norm_fusion_across_styles():
    """The same SP fusion on the other model styles: fused where an RMSNorm reads the reduced sum (with or
    without a residual add, both weight orders), left alone with a reason elsewhere; numbers equal TP=1."""
    from style_models import STYLES

    counts = [1, 5, 33]
    reference = tpweave.launch(workers.style_outputs, STYLES, counts, False, nprocs=1)[0]
    results = tpweave.launch(workers.style_outputs, STYLES, counts, True, SP_FUSED_NORM, nprocs=2)
    for rank_out in results:
        num_fused = {}
        for style in STYLES:
            eager, compiled, (num_compiles, graphs, text, _) = rank_out[style]
            assert 1 <= num_compiles <= MAX_GRAPHS, text
            for _before, after, sites in graphs:
                norm_sites = [s for s in sites if s[0] == "mm_rs_rms_norm"]
                num_fused.setdefault(style, set()).add(sum(s[1] == "fused" for s in norm_sites))
                assert after.get("mm_rs_rms_norm", 0) == sum(s[1] == "fused" for s in norm_sites), text
                assert all(s[2] for s in norm_sites if s[1] == "left alone"), text
            for got_outs, eager_outs, ref_outs in zip(compiled, eager, reference[style][0]):
                for got, want, ref in zip(got_outs, eager_outs, ref_outs):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=style)
                    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=style)
        # post-norm LayerNorm: no RMSNorm; parallel residual: its one reduce-scatter sums two matmuls (no mm_rs)
        assert num_fused == {
            "postnorm": {0},
            "parallel": {0},
            "gemma": {2},
            "fused_residual": {2},
            "funcol": {2},
            "row_bias": {0},
        }


def test_graph_breaks_and_recompile_limit_are_reported():
    """What Dynamo does quietly is said in the report: a forward split by a graph break (each graph
    rewritten on its own, numbers unchanged), and a recompile limit reached (tpweave's two variants
    share one code object's limit, so it is scaled by them; past it the model runs eagerly, correctly)."""
    counts = [1, 5, 33]
    for rank_out in tpweave.launch(workers.reported_dynamo_limits, counts, nprocs=2):
        for name, (outs, _notes, _num_compiles, _after) in rank_out.items():
            for got, want in outs:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)
        _, notes, num_compiles, after = rank_out["graph_break"]
        assert num_compiles == 4 and sorted(v for v, _ in after) == ["plain"] * 2 + ["sp"] * 2, (
            after
        )  # two graphs per variant
        assert all("all_reduce" not in a and a.get("mm_rs") == 1 for v, a in after if v == "sp"), after
        assert sum("Dynamo split the forward into 2 graphs" in n for n in notes) == 2, notes  # sp and plain
        assert not any("recompile limit" in n for n in notes), notes
        _, notes, num_compiles, _ = rank_out["prenorm"]
        assert num_compiles == 2 and notes == [], notes
        _, notes, num_compiles, _ = rank_out["gemma"]
        assert num_compiles == 0 and any("recompile limit" in n and "'forward'" in n for n in notes), notes


TOKEN_SPLIT = {"sp": False, "token_split_min_tokens": 4, "table": None, "all_reduce_rms_norm_policy": "sequential"}


def uninterleaved_all_reduces(schedule: list[str]) -> list[int]:
    """Positions of the all-reduce starts (all but the last) with no matmul of the other subset between them
    and their waits, in a token-split graph's schedule ("mm A", "all_reduce B", "wait B", ...)."""
    starts = [i for i, e in enumerate(schedule) if e.startswith("all_reduce")]
    bad = []
    for i in starts[:-1]:
        subset = schedule[i].split()[1]
        wait = next(j for j in range(i + 1, len(schedule)) if schedule[j] == f"wait {subset}")
        if f"mm {'B' if subset == 'A' else 'A'}" not in schedule[i + 1 : wait]:
            bad.append(i)
    return bad


def test_token_split_point_rounds_to_whole_tiles_from_512_rows():
    from tpweave.compiler.token_split import split_point

    assert [split_point(m) for m in (4, 5, 64, 511, 512, 600, 1000, 2048, 2100)] == [
        2, 2, 32, 255, 256, 256, 384, 1024, 1024
    ]  # fmt: skip


def test_the_interleaving_check_catches_lock_step_subsets():
    lock_step = ["mm A", "mm B", "all_reduce A", "all_reduce B", "wait A", "wait B", "mm A", "mm B"]
    assert uninterleaved_all_reduces(lock_step) == [2]
    staggered = ["mm A", "all_reduce A", "mm B", "all_reduce B", "wait A", "mm A", "wait B", "mm B"]
    assert uninterleaved_all_reduces(staggered) == []


@pytest.mark.parametrize("tp", [2, 3])
def test_token_split_equals_unsplit_and_single_rank_and_interleaves(tp, reference_logits):
    """The plain TP graph as two token subsets (compiler/token_split.py), the split variant from M = 4 on:
    logits equal eager TP and the unsharded model at M odd, M < 2 x TP, and batches of three sequences whose
    split falls inside one; one split graph for every M >= 4; every layer's two all-reduces run once per
    subset, each (but the last) with the other subset's matmuls between its start and its wait. TP 2: each
    subset's all-reduce + residual + RMSNorm as the fused op started on a side stream (composed on CPU), waited for
    where the all-reduce was; TP 3: token_split_sms=0, the process group's all-reduces. (TP 4's split graph:
    tests/test_invariant.py, under the ordered strategies.)"""
    counts = [1, 3, 5, 64, 129, 1000]  # 1000: subset A rounded to whole 128-row tiles, in the same graph
    dtypes = ("float32", "bfloat16")
    fused = tp != 3
    options = TOKEN_SPLIT if fused else {**TOKEN_SPLIT, "token_split_sms": 0}
    results = tpweave.launch(workers.llama_compiled_outputs, "tiny", counts, dtypes, options, nprocs=tp)
    for rank_out in results:
        for dtype in dtypes:
            split = [g for g in rank_out[(dtype, "graphs")] if g[0] == "split"]
            assert len(split) == 1, rank_out[(dtype, "report")]
            _, before, after, sites = split[0]
            assert before == {"all_reduce": 2 * NUM_LAYERS + 1, "all_gather_into_tensor": 1}
            assert [s[2] for s in sites if s[1] == "token split"] == ["subset A", "subset B"] * 2 * NUM_LAYERS
            # the embedding's all-reduce (no matmul before it) is left whole
            if fused:  # every layer's two reductions, the last one's norm being the final norm
                assert after == {"all_reduce": 1, "all_reduce_rms_norm_split": 4 * NUM_LAYERS,
                                 "all_gather_into_tensor": 1}, rank_out[(dtype, "report")]  # fmt: skip
                side = [s[2] for s in sites if s[:2] == ("all_reduce_rms_norm", "fused")]
                assert len(side) == 4 * NUM_LAYERS and all("residual add + RMSNorm" in r for r in side), side
            else:
                assert after == {"all_reduce": 4 * NUM_LAYERS + 1, "all_gather_into_tensor": 1}
            (schedule,) = [s for v, s, _ in rank_out[(dtype, "schedules")] if v == "split"]
            # qkv, o_proj, gate_up, down per layer, and the LM head (logits of every token here)
            assert schedule.count("mm A") == schedule.count("mm B") == 4 * NUM_LAYERS + 1
            assert uninterleaved_all_reduces(schedule) == [], schedule
            for m in counts:
                got = rank_out[(dtype, m, "compiled")]
                assert _close(got, rank_out[(dtype, m, "eager")], dtype), (tp, dtype, m)
                assert _close(got, reference_logits[(dtype, m)], dtype), (tp, dtype, m)


def test_token_split_rules_on_a_traced_batch_seq_graph():
    """The batch split's rules on a (batch, seq) graph traced with symbolic sizes (no ranks: the all-reduces run
    as copies): attention as bmm over (batch x heads) rows and a per-sequence mask stay split; a permute that
    puts the sequence first gets the subsets joined, with a note. Numbers equal the unsplit graph's at every
    batch from one graph (2 and 3: subsets of one sequence; 1, which tpweave's graphs never see: A empty)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tpweave.compiler.graph_utils import aten, funcol
    from tpweave.compiler.report import GraphReport
    from tpweave.compiler.token_split import TokenSplitPass
    from tpweave.compiler.tp_group import TPGroup

    hidden, heads = 8, 2

    def layer(x, w_in, w_out, w_seq, reduce):
        b, s, _ = x.shape
        h = (x.reshape(b * s, hidden) @ w_in).reshape(b, s, heads, hidden // heads)
        q = h.permute(0, 2, 1, 3)  # (B, heads, S, hd): the batch still leading
        mask = (x.sum(-1) > 0)[:, None, None, :]  # (B, 1, 1, S): one per sequence
        a = (torch.where(mask, q @ q.transpose(-1, -2), -1.0).softmax(-1) @ q).permute(0, 2, 1, 3)
        seq_major = h.permute(1, 0, 2, 3).reshape(s * b, hidden)  # rows (seq, batch): no longer two subsets
        return x + reduce((a.reshape(b * s, hidden) @ w_out + seq_major @ w_seq).reshape(b, s, hidden))

    weights = [torch.randn(hidden, hidden) for _ in range(3)]
    all_reduce = lambda y: funcol.wait_tensor(funcol.all_reduce(y, "sum", "tp"))  # noqa: E731
    gm = make_fx(lambda x, *w: layer(x, *w, all_reduce), tracing_mode="symbolic")(torch.randn(5, 3, hidden), *weights)
    num_bmm = sum(n.target is aten.bmm.default for n in gm.graph.nodes)
    report = GraphReport("split")
    assert TokenSplitPass(gm.graph, TPGroup("tp", 0, 2), report).run()
    assert sum(n.target is aten.bmm.default for n in gm.graph.nodes) == 2 * num_bmm
    assert [s.reason for s in report.sites] == ["subset A", "subset B"]
    assert [n for n in report.notes if "joined" in n] == [
        "token split: subsets joined (cat) before 1 op(s): a permute that moves the leading dim"
    ], report.notes
    assert uninterleaved_all_reduces(report.schedule) == [] and "mm B" in report.schedule
    for n in gm.graph.nodes:
        if n.target in (funcol.all_reduce.default, funcol.wait_tensor.default):
            n.target, n.args = aten.clone.default, n.args[:1]
    gm.recompile()
    for batch in (1, 2, 3, 4, 7):
        x = torch.randn(batch, 5, hidden)
        torch.testing.assert_close(gm(x, *weights), layer(x, *weights, lambda y: y), atol=1e-5, rtol=1e-5)


# (model kwargs, shapes): both attention styles at every shape (and seq = 1 with batch >= 2 for SDPA); the
# other norms, raw-parameter matmuls, an op the pass does not know, and flattened MoE tokens at two shapes
# every shape pattern with the first two models; (3, 7) (subsets of one and of two sequences) with the others
TOKEN_SPLIT_FOREIGN = [
    ({"norm": "hand"}, [(2, 3), (3, 7), (1, 5), (1, 1)]),  # B = 2, 3, a batch of one sequence, fewer tokens than 4
    ({"sdpa": True}, [(3, 7), (2, 64), (4, 1)]),  # seq 1 after seq > 1
    ({"norm": "fused"}, FOREIGN_SHAPES[1:2]),
    ({"norm": "layernorm"}, FOREIGN_SHAPES[1:2]),
    ({"model_name": "MatmulMLPModel"}, FOREIGN_SHAPES[1:2]),
    ({"unknown_op": True}, FOREIGN_SHAPES[1:2]),
    ({"model_name": "MoEModel"}, FOREIGN_SHAPES[:2]),
]


def test_token_split_runs_batch_seq_models_as_two_sets_of_sequences(foreign_reference):
    """(batch, seq) models split by sequences (compiler/token_split.py): subset A = batch elements [0, B // 2),
    attention (matmuls + softmax, or SDPA with its per-sequence mask and rotary positions sliced) stays split.
    Split graphs serve every batch >= 2 (B = 2 and 3, subsets of one sequence, may specialize); a batch of one
    sequence gets a graph of its own, left whole with a note. Each all-reduce runs once
    per subset, with the other subset's matmuls before its wait. An op the pass does not know (cumsum) gets
    the subsets joined first, with a note; MoE blocks (tokens flattened to B * S rows, sorted by expert) are
    split by tokens and joined before the routing. Logits equal eager TP and TP=1."""
    cases = [(shapes, kwargs) for kwargs, shapes in TOKEN_SPLIT_FOREIGN]
    results = tpweave.launch(workers.foreign_cases_outputs, cases, TOKEN_SPLIT, nprocs=2)
    for rank_out in results:
        for (kwargs, shapes), out in zip(TOKEN_SPLIT_FOREIGN, rank_out):
            # TP=1's logits by shape (FOREIGN_SHAPES' order)
            reference = dict(zip(FOREIGN_SHAPES, foreign_reference.get("unknown" if kwargs.get("unknown_op")
                                                                       else kwargs.get("norm"), [])))  # fmt: skip
            for shape, compiled, eager in zip(shapes, out["compiled"], out["eager"], strict=True):
                torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5, msg=f"{kwargs} {shape}")
                if shape in reference:
                    torch.testing.assert_close(compiled, reference[shape], atol=1e-4, rtol=1e-4)
            split = [(g, sched) for g, sched in zip(out["graphs"], out["schedules"]) if g[0] == "split"]
            notes = [n for g, _ in split for n in g[4]]
            if kwargs.get("model_name") == "MoEModel":
                assert any("joined (cat) before" in n and "topk" in n for n in notes), out["report"]
                continue
            whole = [g for g, _ in split if "token split: left alone, a batch of one sequence" in g[4]]
            assert len(whole) == any(b == 1 and b * s >= 4 for b, s in shapes), out["report"]
            assert all(g[2] == g[1] for g in whole), out["report"]
            by_sequences = [(g, sched) for g, sched in split if g not in whole]
            # B = 2, B = 3 and B >= 4 may each specialize (a subset of one sequence), per seq pattern
            patterns = {(min(b, 4), s == 1) for b, s in shapes if b >= 2 and b * s >= 4}
            assert 1 <= len(by_sequences) <= len(patterns), out["report"]
            for (_, before, after, sites, graph_notes), schedule in by_sequences:
                # each subset's all-reduce: the process group's, or fused with its residual add + RMSNorm
                assert (
                    after.get("all_reduce", 0) + after.get("all_reduce_rms_norm_split", 0) == 2 * before["all_reduce"]
                )
                subsets = [s[2] for s in sites if s[1] == "token split"]
                assert subsets == ["subset A", "subset B"] * before["all_reduce"], out["report"]
                if kwargs.get("unknown_op"):  # the residual joined for cumsum: no overlap across it
                    assert any("joined (cat) before 2 op(s): cumsum" in n for n in graph_notes), graph_notes
                else:
                    assert not any("joined" in n for n in graph_notes), graph_notes
                    assert uninterleaved_all_reduces(schedule) == [], schedule


def test_hf_llama_token_split_by_sequences():
    """Hugging Face Llama (SDPA attention, sharded with torch's parallelize_module) with the token-split options:
    its four all-reduces run once per set of sequences, interleaved, attention stays split, nothing is joined
    but the graph outputs; a batch of one sequence runs whole. Logits equal the unsharded model's."""
    pytest.importorskip("transformers")
    shapes = [(2, 3), (4, 16), (1, 7)]
    for rank_out in tpweave.launch(workers.hf_model_outputs, "llama", shapes, TOKEN_SPLIT, nprocs=2, timeout_s=900):
        for got, want in zip(rank_out["got"], rank_out["want"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        split = [(g, sites, sched) for g, sites, sched in zip(rank_out["graphs"], rank_out["sites"],
                                                              rank_out["schedules"]) if g[0] == "split"]  # fmt: skip
        by_sequences = [(sites, sched) for (_, _, after), sites, sched in split
                        if after.get("all_reduce", 0) + after.get("all_reduce_rms_norm_split", 0) == 8]  # fmt: skip
        # B = 2 and B = 4: a subset of one sequence at B = 2 may specialize the graph
        assert len(by_sequences) in (1, 2) and len(split) == len(by_sequences) + 1, rank_out["report"]
        for sites, schedule in by_sequences:
            assert [s[2] for s in sites if s[1] == "token split"] == ["subset A", "subset B"] * 4, rank_out["report"]
            assert uninterleaved_all_reduces(schedule) == [], schedule
        assert "token split: left alone, a batch of one sequence" in rank_out["notes"], rank_out["report"]
        assert not any("joined" in n for n in rank_out["notes"]), rank_out["report"]


def test_residual_stream_is_stored_once_not_recomputed_in_each_norm():
    """A residual stream h = h + lin(rms_norm(h)), layers deep, through the real backend (CPU): with
    realize_residuals (default) each add + norm kernel reads at most the previous sum and the new summand, two
    activations; Inductor's default (the option off) recomputes the chain in each norm kernel from up to 4 earlier
    summands. Numbers equal the eager module's either way."""
    import re

    import torch.nn.functional as F
    from torch import nn
    from torch._inductor.utils import run_and_get_code

    class ResidualStack(nn.Module):
        def __init__(self, layers: int = 6, hidden: int = 64):
            super().__init__()
            self.lins = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(layers))

        def forward(self, x):
            h = x
            for lin in self.lins:
                h = h + lin(F.rms_norm(h, (h.shape[-1],)))
            return F.rms_norm(h, (h.shape[-1],))

    module = ResidualStack().requires_grad_(False)
    x = torch.randn(37, 64)
    reads = {}
    for on in (True, False):
        torch._dynamo.reset()
        out, codes = run_and_get_code(tpweave.compile(module, realize_residuals=on), x)
        torch.testing.assert_close(out, module(x), rtol=1e-5, atol=1e-5)
        # each CPU kernel's argument types: the const pointers are the tensors it reads
        kernels = re.findall(r"cpp_fused_(\w*mean\w*) = async_compile.cpp_pybinding\(\[([^\]]*)\]", "\n".join(codes))
        assert kernels, codes
        reads[on] = [args.count("const float*") for _, args in kernels]
    assert max(reads[True]) <= 2, reads
    assert max(reads[False]) > 2, reads  # what the option changes


def test_torch_symm_mem_strategies_keep_their_sites_under_graph_modes():
    """torch's symm_mem strategies (symm_mem_fused, symm_mem_one_shot, symm_mem_two_shot) cannot run on ranks
    emulated on one GPU (tests/test_gpu_graph_modes.py runs tpweave's own kernels that way): their graph structure
    under Inductor's CUDA graph trees and graph partition is checked here. Every site keeps its policy (nothing is
    swapped for 'sequential' under the graph modes) and the numbers equal eager TP (on the CPU each runs its
    decomposed path)."""
    out = tpweave.launch(workers.graph_mode_structure, [3, 32, 100], nprocs=2)
    for rank_out in out:
        assert rank_out["dispatched"] == [
            "symm_mem_fused",
            "symm_mem_one_shot@0,symm_mem_two_shot@16",
        ], rank_out["dispatched"]
        for m in (3, 32, 100):
            assert rank_out[m] < 1e-4, (m, rank_out[m])
