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
    assert f"decode GEMV: 2 linear layers ({fused} reading silu(gate) * up, 0 taking" in str(
        compiled.compile_report.graphs[0]
    )


def test_only_a_graph_input_is_read_as_a_weight():
    """The GEMV reads W before its PDL wait, so a matmul is routed only where its transposed operand is an input of
    the graph (a weight no kernel of the graph writes); one computed in the graph stays a matmul."""

    class TwoProducts(nn.Module):
        def forward(self, x, w, z):
            return x @ w.t() + x @ (z * 2).t()

    x, w, z = torch.randn(5, 8), torch.randn(6, 8), torch.randn(6, 8)
    compiled = tpweave.compile(TwoProducts())
    torch.testing.assert_close(compiled(x, w, z), TwoProducts()(x, w, z))
    assert set(_routed(compiled)) == {(1, 0)}, _routed(compiled)


def test_pass_off_leaves_the_matmuls():
    module = MLPBlock("silu")
    compiled = tpweave.compile(module, decode_gemv=False)
    x = torch.randn(4, 64)
    torch.testing.assert_close(compiled(x), module(x))
    assert set(_routed(compiled)) == {(0, 0)}
    with pytest.raises(TypeError, match="decode_gemv must be True or False"):
        tpweave.compile(module, decode_gemv=1)
    with pytest.raises(TypeError, match="norm_gemv must be True or False"):
        tpweave.compile(module, norm_gemv="yes")


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


class ResidualNormLinear(nn.Module):
    """h = x + r -> RMSNorm (in a model's style) -> a linear layer, and h read again after it (the residual
    stream). "two_readers": the norm's output feeds two linear layers (separate q and k projections)."""

    def __init__(self, style: str, hidden: int = 64, out: int = 48):
        super().__init__()
        self.style = style
        self.w = nn.Parameter(torch.randn(hidden) * 0.1 + (0.0 if style == "gemma" else 1.0))
        self.lin = nn.Linear(hidden, out, bias=False)
        self.lin2 = nn.Linear(hidden, out, bias=False)

    def norm(self, h):
        if self.style == "f_rms_norm":
            return F.rms_norm(h, (h.shape[-1],), self.w, eps=1e-5)
        h32 = h.float()
        n32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.style == "gemma":
            return (n32 * (1.0 + self.w.float())).to(h.dtype)
        return self.w * n32.to(h.dtype)  # HF Llama

    def forward(self, x, r):
        h = x + r
        y = self.norm(h)
        q = self.lin(y)
        if self.style == "two_readers":
            q = q + self.lin2(y)
        return q, h * 2


def _normed(compiled):
    return [g.norm_linears for g in compiled.compile_report.graphs]


@pytest.mark.parametrize("style,fused", [("llama", 1), ("gemma", 1), ("f_rms_norm", 1), ("two_readers", 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_norm_and_linear_become_one_op(style, fused, dtype):
    """The add + RMSNorm read by one linear layer alone becomes tpweave::rms_norm_linear (both of its outputs
    used: the projection, and the residual stream after it); numbers against eager at M = 1, 3, 20. (Inference: a
    training graph saves the norm's intermediates for the backward, and the norm stays.)"""
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = ResidualNormLinear(style).to(dtype).requires_grad_(False)
    compiled = tpweave.compile(module, norm_gemv=True)
    for m in (1, 3, 20):
        x, r = torch.randn(m, 64, dtype=dtype), torch.randn(m, 64, dtype=dtype)
        (q, h), (want_q, want_h) = compiled(x, r), module(x, r)
        torch.testing.assert_close(h, want_h, rtol=0, atol=0)
        atol = 1e-5 if dtype == torch.float32 else 2 * 2**-8 * want_q.abs().max().item()
        torch.testing.assert_close(q, want_q, rtol=0, atol=atol)
    assert set(_normed(compiled)) == {fused}, _normed(compiled)
    assert set(_routed(compiled)) == {(1 if style != "two_readers" else 2, 0)}


def test_norm_without_residual_add_is_left_alone():
    """No add before the norm (a first layer's input norm): the linear layer is routed, the norm stays Inductor's."""

    class NoAdd(ResidualNormLinear):
        def forward(self, x, r):
            return self.lin(self.norm(x)) + r[:, :48]

    torch._dynamo.reset()
    module = NoAdd("llama").requires_grad_(False)
    compiled = tpweave.compile(module, norm_gemv=True)
    x, r = torch.randn(3, 64), torch.randn(3, 64)
    torch.testing.assert_close(compiled(x, r), module(x, r), rtol=1e-5, atol=1e-5)
    assert set(_normed(compiled)) == {0} and set(_routed(compiled)) == {(1, 0)}


def test_rms_norm_linear_op_on_cpu():
    """The op's CPU path: the add + norm reference, then the matmul; h = s + residual."""
    s, r = torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(2, 16, dtype=torch.bfloat16)
    g, w = torch.rand(16, dtype=torch.bfloat16) + 0.5, torch.randn(8, 16, dtype=torch.bfloat16)
    y, h = torch.ops.tpweave.rms_norm_linear(s, r, g, w, 1e-6, False)
    from tpweave.ops import rms_norm

    ny, nh = rms_norm.add_rms_norm_reference(s, r, g, eps=1e-6, weight_in_fp32=False)
    torch.testing.assert_close(h, nh, rtol=0, atol=0)
    torch.testing.assert_close(y, ny @ w.t(), rtol=0, atol=0)


def test_chained_residual_norms_read_the_previous_ops_sum(monkeypatch):
    """Two residual add + norm + linear blocks in a row: the second op's residual is the first op's h, and no add is
    left in the graph (a stale reference to the first add would keep a second copy of the sum)."""
    from tpweave.compiler import decode_gemv

    graphs = []

    def keep(graph, *, report, norms):
        out = route(graph, report=report, norms=norms)
        graphs.append(graph)
        return out

    route = decode_gemv.route_linears
    monkeypatch.setattr(decode_gemv, "route_linears", keep)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = ResidualNormLinear("llama", out=64), ResidualNormLinear("llama", out=64)

        def forward(self, x, r):
            h1 = x + r
            h2 = h1 + self.a.lin(self.a.norm(h1))
            return h2 + self.b.lin(self.b.norm(h2))

    torch._dynamo.reset()
    module = Two().requires_grad_(False)
    compiled = tpweave.compile(module, norm_gemv=True)
    x, r = torch.randn(1, 64), torch.randn(1, 64)
    torch.testing.assert_close(compiled(x, r), module(x, r), rtol=1e-5, atol=1e-5)
    assert set(_normed(compiled)) == {2}
    adds = [n for n in graphs[0].nodes if n.target is torch.ops.aten.add.Tensor and len(n.all_input_nodes) == 2]
    assert len(adds) == 1, str(graphs[0])  # the last add; h1 and h2 are the ops' second outputs


def test_norms_stay_inductors_by_default():
    torch._dynamo.reset()
    module = ResidualNormLinear("llama").requires_grad_(False)
    compiled = tpweave.compile(module)
    x, r = torch.randn(1, 64), torch.randn(1, 64)
    torch.testing.assert_close(compiled(x, r), module(x, r), rtol=1e-5, atol=1e-5)
    assert set(_normed(compiled)) == {0} and set(_routed(compiled)) == {(1, 0)}
