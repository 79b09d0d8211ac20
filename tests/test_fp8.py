"""FP8 (e4m3) dense models on CPU: quantized linears, TP=N against TP=1, SP moving FP8 bytes in its
all-gathers, and FP8 checkpoints (per-channel, per-tensor and static input scales) loaded by slices."""

import pytest
import torch

import tpweave
import workers
from tpweave.models import ModelConfig, get_preset, random_hf_state, save_hf_checkpoint
from tpweave.ops import fp8

COUNTS = [1, 3, 37]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_quantize_and_scaled_matmul():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    w = torch.randn(48, 64, generator=gen) * 0.1
    ref = x.float() @ w.t()
    xq, xs = fp8.quantize_rows(x)
    assert xq.dtype == fp8.FP8 and xs.shape == (9, 1)
    for per_channel in (True, False):
        wq, ws = fp8.quantize_weight(w, per_channel=per_channel)
        ws = ws if per_channel else ws.expand(48).contiguous()
        native = fp8.scaled_mm(xq, wq, xs, ws, None, torch.bfloat16)  # torch._scaled_mm where the CPU has it
        emulated = fp8.scaled_mm(xq, wq, xs, ws, None, torch.float32)
        assert _rel(native.float(), ref) < 0.06 and _rel(emulated.float(), ref) < 0.06
        torch.testing.assert_close(native.float(), emulated.float(), atol=2e-2 * ref.abs().max().item(), rtol=0)
    xq, xs = fp8.quantize_static(x * 100, torch.tensor(8.0 / 448))  # static: values beyond 8 saturate
    assert xq.float().abs().max() == 448 and xs.shape == (9, 1)


@pytest.fixture(scope="module")
def fp8_reference():
    single = tpweave.TPContext.single()
    bf16 = workers.eager_logits(single, "tiny", COUNTS, ("bfloat16",))
    return workers.fp8_outputs(single, "tiny-fp8", COUNTS, compile_model=False), bf16


@pytest.mark.parametrize("tp", [2])
def test_fp8_tp_matches_single_rank_and_gathers_fp8(tp, fp8_reference):
    ref, bf16 = fp8_reference
    results = tpweave.launch(workers.fp8_outputs, "tiny-fp8", COUNTS, nprocs=tp)
    for out in results:
        assert 1 <= out["num_compiles"] <= 3  # M = 1, every other M (+1 spare)
        for m in COUNTS:
            want = ref[(m, "eager")]
            # FP8 really quantizes: away from the bf16 model, but within quantization error of it
            assert 0 < _rel(want, bf16[("bfloat16", m)]) < 0.2
            # row-parallel layers quantize each rank's K-slice of a token with its own scale: TP=N
            # rounds differently from TP=1, by FP8 rounding only
            assert _rel(out[(m, "eager")], want) < 0.1, m
            assert _rel(out[(m, "compiled")], out[(m, "eager")]) < 0.1, m
        gathers = [s for s in out["sites"] if s[0] == "all_gather" and s[1] == "inserted" and "scaled_mm" in s[2]]
        # in every graph, each quantized column-parallel input (qkv, gate_up per layer) is gathered as FP8 +
        # its per-token scale (sites of all graphs, so times the number of graphs)
        cfg, num_graphs = get_preset("tiny-fp8"), out["num_compiles"]
        assert sorted(s[3] for s in gathers) == sorted(["float8_e4m3fn", "float32"] * 2 * cfg.num_layers * num_graphs)
        # async TP: each FP8 gather pair + its scaled matmul, and each scaled matmul + reduce-scatter, fused
        fused = [s[2].split(",")[0] for s in out["sites"] if s[1] == "fused"]
        assert sum(f.startswith("tpweave::ag_scaled_mm") for f in fused) == 2 * cfg.num_layers * num_graphs
        assert sum(f.startswith("tpweave::scaled_mm_rs") for f in fused) == 2 * cfg.num_layers * num_graphs


def test_fp8_halves_the_all_gathered_bytes():
    bf16 = tpweave.launch(workers.fp8_outputs, "tiny", [8], nprocs=2)[0]["gathered_bytes_per_token"]
    fp8_bytes = tpweave.launch(workers.fp8_outputs, "tiny-fp8", [8], nprocs=2)[0]["gathered_bytes_per_token"]
    cfg = get_preset("tiny")
    # per layer 2 gathers (qkv and gate/up inputs) of H values, + the final norm's H values for the LM head
    # (bf16 in both)
    assert bf16 == (2 * cfg.num_layers + 1) * cfg.hidden_size * 2
    assert fp8_bytes == 2 * cfg.num_layers * (cfg.hidden_size * 1 + 4) + cfg.hidden_size * 2  # FP8 rows + an fp32 scale


def test_fp8_checkpoint_per_tensor_and_static_scales(tmp_path):
    cfg = get_preset("tiny-fp8").replace(activation_scheme="static")
    state = random_hf_state(cfg, seed=3, dtype=torch.bfloat16)
    # layer 0's q_proj and down_proj as per-tensor FP8, the way many checkpoints store them
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        w = state[name + ".weight"].float() * state[name + ".weight_scale"][:, None]
        state[name + ".weight"], state[name + ".weight_scale"] = fp8.quantize_weight(w, per_channel=False)
    state["model.layers.1.self_attn.k_proj.input_scale"] = torch.tensor(16.0 / 448)  # merged with q, v: the max is used
    save_hf_checkpoint(tmp_path, cfg, state, num_files=2)
    loaded = ModelConfig.from_dir(tmp_path)
    assert loaded.quantization == "fp8" and loaded.activation_scheme == "static"
    ref = workers.fp8_outputs(tpweave.TPContext.single(), str(tmp_path), COUNTS, compile_model=False)
    out = tpweave.launch(workers.fp8_outputs, str(tmp_path), COUNTS, nprocs=2)[0]
    for m in COUNTS:
        # static scales are the same on every rank: TP=2 quantizes like TP=1, and differs only by the
        # bf16 rounding of summing partials (the bf16 model's tolerance in test_foundation)
        torch.testing.assert_close(
            out[(m, "eager")], ref[(m, "eager")], atol=6e-2 * ref[(m, "eager")].abs().max().item(), rtol=0
        )
        assert _rel(out[(m, "compiled")], out[(m, "eager")]) < 0.1  # Inductor rounds the quantization its own way


def test_fp8_config_errors():
    base = get_preset("tiny").replace(quantization="fp8").to_hf()
    with pytest.raises(ValueError, match="block-wise FP8"):
        ModelConfig.from_hf({**base, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    with pytest.raises(ValueError, match="unsupported quantization_config.quant_method 'awq'"):
        ModelConfig.from_hf({**base, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="activation_scheme must be 'dynamic' or 'static'"):
        tpweave.models.build_model(
            get_preset("tiny-fp8").replace(activation_scheme="dynamc"), tp=tpweave.TPContext.single()
        )
