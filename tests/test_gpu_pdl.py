"""GPU: programmatic dependent launch (ops/pdl.py). Decode layers made of tpweave's kernels alone (GEMV, RoPE, paged
decode + merge, GEMV with silu * mul), each reading what the one before wrote, replayed from a CUDA graph: the
results with PDL equal those without, bit for bit (a kernel that read its input before the previous kernel
finished would differ). And a compiled model, whose Inductor kernels launch with PDL too, gives the same logits
with it and without."""

import pytest
import torch

import tpweave
from test_gpu_attention import _cos_sin, _paged_case
from tpweave.models import build_model
from tpweave.ops import pdl
from tpweave.runtime.context import TPContext

pytestmark = pytest.mark.gpu(gpus=1)


def test_pdl_is_on_for_hopper_and_off_by_environment(monkeypatch):
    dev = torch.device("cuda")
    assert pdl.enabled(dev) == (torch.cuda.get_device_capability() >= (9, 0))
    monkeypatch.setenv("TPWEAVE_PDL", "0")
    assert not pdl.enabled(dev)


def _decode_layers(batch: int, layers: int, seed: int):
    """A function running `layers` decode layers of tpweave kernels on static inputs, and its output."""
    heads, kv_heads, head_dim, hidden, inter = 32, 8, 128, 4096, 14336
    args = _paged_case([1] * batch, [300 + 97 * i for i in range(batch)], heads=heads, kv_heads=kv_heads, seed=seed)
    _, _, _, k_cache, v_cache, slots, cu, ctx, tables, bs, scale = args
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def weight(n, k):
        return (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)

    w_qkv, w_o = weight((heads + 2 * kv_heads) * head_dim, hidden), weight(hidden, heads * head_dim)
    w_gate_up, w_down = weight(2 * inter, hidden), weight(hidden, inter)
    cos_sin = _cos_sin(head_dim)
    positions = (ctx - 1).long()
    x = torch.randn(batch, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    linear = torch.ops.tpweave.linear

    def run():
        h = x
        for _ in range(layers):
            q, k, v = linear(h, w_qkv).view(batch, -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
            a = torch.ops.tpweave.paged_attention(
                q, k, v, k_cache, v_cache, slots, cu, ctx, tables, bs, scale, cos_sin, positions
            )
            h = linear(linear(linear(a.view(batch, -1), w_o), w_gate_up), w_down, True)
        return h

    return run


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_kernel_chain_with_pdl_equals_without(batch, monkeypatch):
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL needs sm_90+ and a Triton with griddepcontrol")
    outs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("TPWEAVE_PDL", setting)
        run = _decode_layers(batch, layers=6, seed=batch)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            run()  # compiles the kernels outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        got = []
        for _ in range(20):
            graph.replay()
            got.append(out.clone())
        assert all(torch.equal(g, got[0]) for g in got), "replays of one graph differ"
        outs[setting] = got[0]
    assert torch.equal(outs["1"], outs["0"])


def test_compiled_model_with_inductor_pdl_equals_without(monkeypatch):
    model = build_model("tiny", tp=TPContext.single("cuda"), dtype=torch.bfloat16, num_layers=2)
    ids, pos = torch.randint(0, 1000, (5,), device="cuda"), torch.arange(5, device="cuda")
    cu = torch.tensor([0, 5], dtype=torch.int32, device="cuda")
    logits = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("TPWEAVE_PDL", setting)
        torch._dynamo.reset()
        compiled = tpweave.compile(model)
        logits[setting] = compiled(ids, pos, cu)
    assert torch.equal(logits["1"], logits["0"])
