"""GPU: the decode-size GEMV (ops/gemv.py) against an fp32 matmul, eager and inside a CUDA graph, and the
compiled model with the pass that routes linear layers through it (compiler/decode_gemv.py)."""

import pytest
import torch

import tpweave
from tpweave.models import build_model
from tpweave.ops import gemv
from tpweave.runtime.context import TPContext

pytestmark = pytest.mark.gpu(gpus=1)


def _check(y, x, w, silu_mul):
    x32 = gemv.silu_and_mul(x).float() if silu_mul else x.float()
    want = x32 @ w.float().t()
    # bf16 output rounding (and the fp32 sum's order): within 2 ulps of the largest value
    torch.testing.assert_close(y.float(), want, atol=2 * 2**-8 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("n,k", [(4096, 4096), (200, 1000), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 2, 5, 16, 17, 40, 64, 65])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_linear_op_matches_fp32_matmul(m, n, k, silu_mul):
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    w = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) / k**0.5
    x = torch.randn(m, 2 * k if silu_mul else k, device="cuda", generator=gen).to(torch.bfloat16)
    y = torch.ops.tpweave.linear(x, w, silu_mul)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _check(y, x, w, silu_mul)
    if not gemv.supported(x, w):  # torch's matmul above the op's row limit: exactly cuBLAS's result
        torch.testing.assert_close(y, (gemv.silu_and_mul(x) if silu_mul else x) @ w.t(), atol=0, rtol=0)


def test_gemv_rows_of_a_larger_tensor_and_cuda_graph_replay():
    """x a row slice of a larger tensor (the token split's subsets), then replays of a captured call on new data."""
    w = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(10, 2 * 768, device="cuda", dtype=torch.bfloat16)
    x = big[3:6]
    assert gemv.supported(x, w)
    _check(gemv.gemv(x, w, silu_mul=True), x, w, True)
    static = torch.randn(1, 768, device="cuda", dtype=torch.bfloat16)
    gemv.gemv(static, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.gemv(static, w)
    for _ in range(3):
        static.copy_(torch.randn_like(static))
        graph.replay()
        _check(out, static, w, False)


def test_compiled_model_with_decode_gemv_matches_cublas():
    """tiny preset (bf16): the compiled model with its linear layers through the GEMV (and its norms fused into
    them) gives the logits of the compiled model without it, at M = 1, 5, 16 (GEMV) and 40 (cuBLAS in both)."""
    model = build_model("tiny", tp=TPContext.single("cuda"), dtype=torch.bfloat16, num_layers=2)
    with_gemv = tpweave.compile(model, decode_gemv=True, norm_gemv=True)
    without = tpweave.compile(model, decode_gemv=False)
    for m in (1, 5, 16, 40):
        ids = torch.randint(0, 1000, (m,), device="cuda")
        pos = torch.arange(m, device="cuda")
        cu = torch.tensor([0, m], dtype=torch.int32, device="cuda")
        got, want = with_gemv(ids, pos, cu), without(ids, pos, cu)
        torch.testing.assert_close(got.float(), want.float(), atol=0.05 * want.abs().max().item(), rtol=0)
    routed = [(g.linears, g.gated_linears, g.norm_linears) for g in with_gemv.compile_report.graphs]
    # 2 layers x (qkv, o, gate_up, down) + the LM head; every norm after a residual add goes into the projection
    # after it (qkv, gate_up, the LM head), all but the first layer's input norm
    assert routed and set(routed) == {(9, 2, 4)}, routed


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("weight_in_fp32", [False, True])
@pytest.mark.parametrize("n,k", [(6144, 4096), (200, 1000)])
def test_rms_norm_linear_op_matches_norm_then_fp32_matmul(m, n, k, weight_in_fp32):
    """One row: the GEMV that normalizes as it reads; more rows: the add + norm kernel, then the GEMV. h exact,
    y within the rounding of the normalized row the fused kernel skips (and the output's)."""
    from tpweave.ops import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(n + m)
    s, r = (torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    g = (torch.rand(k, device="cuda", generator=gen) + 0.5).to(torch.float32 if weight_in_fp32 else torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
    y, h = torch.ops.tpweave.rms_norm_linear(s, r, g, w, 1e-5, weight_in_fp32)
    ny, nh = rms_norm.add_rms_norm_reference(s, r, g, eps=1e-5, weight_in_fp32=weight_in_fp32)
    torch.testing.assert_close(h, nh, rtol=0, atol=0)
    want = ny.float() @ w.float().t()
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want, atol=3 * 2**-8 * want.abs().max().item(), rtol=0)


def test_rms_norm_gemv_in_a_cuda_graph_on_new_data():
    s, r = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16), torch.randn(1, 4096, device="cuda").bfloat16()
    g, w = torch.rand(4096, device="cuda").bfloat16() + 0.5, torch.randn(512, 4096, device="cuda").bfloat16() / 64
    gemv.norm_gemv(s, r, g, w, eps=1e-6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, h = gemv.norm_gemv(s, r, g, w, eps=1e-6)
    for _ in range(3):
        s.copy_(torch.randn_like(s))
        graph.replay()
        torch.testing.assert_close(h, s + r, rtol=0, atol=0)
        want = torch.nn.functional.rms_norm((s + r).float(), (4096,), g.float(), eps=1e-6) @ w.float().t()
        torch.testing.assert_close(y.float(), want, atol=3 * 2**-8 * want.abs().max().item(), rtol=0)
