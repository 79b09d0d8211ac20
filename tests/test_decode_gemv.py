"""The decode-GEMV pass (compiler/decode_gemv.py) through the real backend on CPU: which matmuls it routes
through tpweave::linear, which gated MLPs it fuses, and the compiled numbers against the eager module.
(The GEMV kernel itself is checked on the GPU: tests/test_gpu_gemv.py.)"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpweave


def _silu(g, style):
    if style == "sigmoid":
        return g * torch.sigmoid(g)
    if style == "exp":
        return g / (1 + torch.exp(-g))
    return F.silu(g)


class MLPBlock(nn.Module):
    """norm -> gated (or GELU) MLP -> residual, then a biased projection (addmm: left to Inductor)."""

    def __init__(self, style: str, hidden: int = 64, inter: int = 96):
        super().__init__()
        self.style = style
        self.up = nn.Linear(hidden, inter if style == "gelu" else 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)
        self.proj = nn.Linear(hidden, 32, bias=True)

    def forward(self, x):
        h = self.up(F.rms_norm(x, (x.shape[-1],)))
        if self.style == "gelu":
            a = F.gelu(h)
        elif self.style == "swapped":  # silu of the second half: not the [gate | up] layout the kernel reads
            up, gate = h.chunk(2, dim=-1)
            a = F.silu(gate) * up
        elif self.style == "up_first":
            gate, up = h.split(h.shape[-1] // 2, dim=-1)
            a = up * _silu(gate, "sigmoid")
        else:
            gate, up = h.chunk(2, dim=-1)
            a = _silu(gate, self.style) * up
        return self.proj(x + self.down(a))


def _routed(compiled):
    """(linears, gated linears) of each compiled graph."""
    return [(g.linears, g.gated_linears) for g in compiled.compile_report.graphs]


@pytest.mark.parametrize(
    "style,fused", [("silu", 1), ("sigmoid", 1), ("exp", 1), ("up_first", 1), ("swapped", 0), ("gelu", 0)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pass_routes_linears_and_fuses_gated_mlps(style, fused, dtype):
    torch._dynamo.reset()  # each style is a new forward for Dynamo (one class: its recompile limit is shared)
    torch.manual_seed(0)
    module = MLPBlock(style).to(dtype)
    compiled = tpweave.compile(module)
    for m in (1, 3, 20):  # one graph for M >= 2, one for M = 1
        x = torch.randn(m, 64, dtype=dtype)
        want = module(x)
        got = compiled(x)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # the fused activation rounds once where eager rounds silu(gate) and the product
            torch.testing.assert_close(got, want, rtol=0, atol=2 * 2**-8 * want.abs().max().item())
    routed = _routed(compiled)
    # up and down routed (the biased proj is an addmm, left alone); the gated activation fused where recognised
    assert len(routed) >= 2 and set(routed) == {(2, fused)}, routed
    assert f"decode GEMV: 2 linear layers ({fused} reading silu(gate) * up)" in str(compiled.compile_report.graphs[0])


def test_pass_off_leaves_the_matmuls():
    module = MLPBlock("silu")
    compiled = tpweave.compile(module, decode_gemv=False)
    x = torch.randn(4, 64)
    torch.testing.assert_close(compiled(x), module(x))
    assert set(_routed(compiled)) == {(0, 0)}
    with pytest.raises(TypeError, match="decode_gemv must be True or False"):
        tpweave.compile(module, decode_gemv=1)


def test_linear_op_on_cpu_is_the_matmul():
    """The op's CPU path: torch's matmul; silu_mul's activation computed in fp32 and rounded once."""
    x, w = torch.randn(3, 2 * 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)
    gate, up = x.float().chunk(2, dim=-1)
    want = (F.silu(gate) * up).to(torch.bfloat16) @ w.t()
    torch.testing.assert_close(torch.ops.tpweave.linear(x, w, True), want, rtol=0, atol=0)
    torch.testing.assert_close(torch.ops.tpweave.linear(x[:, :8], w, False), x[:, :8] @ w.t(), rtol=0, atol=0)


def test_training_compile_gradients_equal_eager():
    """A training compile: the pass rewrites the forward graph only (the backward has no linear layer of the
    forward's form; the op has no autograd formula and needs none inside a compiled graph); gradients equal eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = MLPBlock("silu")
    compiled = tpweave.compile(module)
    x = torch.randn(5, 64)
    compiled(x).square().sum().backward()
    got = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    module(x).square().sum().backward()
    for n, p in module.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-5)
    assert (compiled.compile_report.graphs[0].linears, compiled.compile_report.graphs[0].gated_linears) == (2, 1)
