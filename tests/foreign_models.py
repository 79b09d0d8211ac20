"""TP models written in a style unlike tpweave's own (the compiler must handle them untouched).

3-D (batch, seq, hidden) activations, separate q/k/v and gate/up linears with biases, in-place
`torch.distributed.all_reduce`, norms written by hand / as F.rms_norm / as nn.LayerNorm, a replicated
embedding whose output meets the first sharded residual, attention as matmuls + softmax or as SDPA with
a per-sequence mask and rotary positions. Weights come from a seed and are sliced by rank, so every TP
degree computes the same function.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN, HEADS, INTER, VOCAB, LAYERS = 48, 12, 96, 60, 2


def _full(gen, *shape, scale=None):
    t = torch.randn(*shape, generator=gen)
    return t * (scale if scale is not None else shape[-1] ** -0.5)


class HandRMSNorm(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(w, requires_grad=False)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


class FusedRMSNorm(HandRMSNorm):
    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.w, eps=1e-5)


class LayerNorm(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.ln = nn.LayerNorm(w.shape[0], eps=1e-5)
        with torch.no_grad():
            self.ln.weight.copy_(w)
            self.ln.bias.copy_(w * 0.1 - 0.1)

    def forward(self, x):
        return self.ln(x)


NORMS = {"hand": HandRMSNorm, "fused": FusedRMSNorm, "layernorm": LayerNorm}


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Block(nn.Module):
    def __init__(self, gen, rank, world, *, norm, reduce_op, unknown_op, num_streams=0, flat_mlp=False):
        super().__init__()
        self.flat_mlp = flat_mlp
        h, d = HIDDEN // HEADS, HEADS // world
        self.heads, self.hd, self.reduce_op, self.unknown_op = d, h, reduce_op, unknown_op
        cols = slice(rank * d * h, (rank + 1) * d * h)
        inter = slice(rank * INTER // world, (rank + 1) * INTER // world)
        self.norm1 = NORMS[norm](1 + 0.1 * torch.randn(HIDDEN, generator=gen))
        self.norm2 = NORMS[norm](1 + 0.1 * torch.randn(HIDDEN, generator=gen))
        self.q, self.k, self.v = (nn.Linear(HIDDEN, d * h) for _ in range(3))
        for lin in (self.q, self.k, self.v):
            w, b = _full(gen, HIDDEN, HIDDEN), 0.1 * torch.randn(HIDDEN, generator=gen)
            lin.weight.data.copy_(w[cols]), lin.bias.data.copy_(b[cols])
        self.o = nn.Linear(d * h, HIDDEN, bias=False)
        self.o.weight.data.copy_(_full(gen, HIDDEN, HIDDEN)[:, cols])
        self.gate, self.up = (
            nn.Linear(HIDDEN, INTER // world, bias=False),
            nn.Linear(HIDDEN, INTER // world, bias=False),
        )
        self.gate.weight.data.copy_(_full(gen, INTER, HIDDEN)[inter])
        self.up.weight.data.copy_(_full(gen, INTER, HIDDEN)[inter])
        self.down = nn.Linear(INTER // world, HIDDEN, bias=False)
        self.down.weight.data.copy_(_full(gen, HIDDEN, INTER)[:, inter])
        self.down_bias = nn.Parameter(0.1 * torch.randn(HIDDEN, generator=gen), requires_grad=False)
        self.num_streams = num_streams
        if num_streams:
            self.stream_w = nn.Parameter(
                1 / num_streams + 0.1 * torch.randn(num_streams, HIDDEN, generator=gen), requires_grad=False
            )
            self.stream_fn = nn.Parameter(_full(gen, num_streams, num_streams * HIDDEN), requires_grad=False)

    def _reduce(self, y):
        if self.reduce_op == "avg":
            group_name = dist.group.WORLD.group_name
            return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(y, "avg", group_name))
        dist.all_reduce(y)
        return y

    def forward(self, x, sdpa=None):
        b, s, _ = x.shape
        if self.num_streams:  # hyper-connection style: the residual copied into streams, then mixed
            streams = x.unsqueeze(2).expand(-1, -1, self.num_streams, -1)
            # per-token stream weights from the flattened streams, a replicated linear times their mean square (HY-V4's
            # hyper-connection): flatten(2) keeps both token dims, which one token alone ([1, 1, n, H] to [1, 1, n * H])
            # leaves ambiguous
            flat = streams.flatten(2)
            pre = torch.sigmoid(F.linear(flat, self.stream_fn) * flat.pow(2).mean(-1, keepdim=True))
            x = (pre.unsqueeze(-1) * streams * self.stream_w).sum(2)
        hx = self.norm1(x)
        q, k, v = (lin(hx).view(b, s, self.heads, self.hd).transpose(1, 2) for lin in (self.q, self.k, self.v))
        if sdpa is not None:  # rotary positions and an additive mask, both (batch, 1, ...)
            cos_B1SD, sin_B1SD, mask_B1SS = sdpa
            q, k = (t * cos_B1SD + _rotate_half(t) * sin_B1SD for t in (q, k))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1SS).transpose(1, 2).reshape(b, s, -1)
        else:
            scores = (q @ k.transpose(-1, -2)) * self.hd**-0.5
            future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            a = (scores.masked_fill(future, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
        x = x + self._reduce(self.o(a))
        if self.unknown_op:
            x = x + 0.1 * torch.cumsum(x, dim=-1) / HIDDEN  # token-wise, but not an op the pass knows
        hx = self.norm2(x)
        if self.flat_mlp:  # on the tokens flattened, as a Hugging Face MoE block runs its shared expert
            hx = hx.view(-1, HIDDEN)
        y = self._reduce(self.down(F.silu(self.gate(hx)) * self.up(hx))) + self.down_bias
        return x + (y.view(b, s, -1) if self.flat_mlp else y)


class ForeignModel(nn.Module):
    def __init__(
        self,
        rank: int,
        world: int,
        *,
        norm="hand",
        reduce_op="sum",
        unknown_op=False,
        num_streams=0,
        sdpa=False,
        flat_mlp=False,
        seed=0,
    ):
        super().__init__()
        styles = dict(num_streams=num_streams, flat_mlp=flat_mlp)
        gen = torch.Generator().manual_seed(seed)
        self.sdpa = sdpa
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.embed.weight.data.copy_(torch.randn(VOCAB, HIDDEN, generator=gen))
        self.blocks = nn.ModuleList(
            Block(gen, rank, world, norm=norm, reduce_op=reduce_op, unknown_op=unknown_op, **styles)
            for _ in range(LAYERS)
        )
        self.norm = NORMS[norm](1 + 0.1 * torch.randn(HIDDEN, generator=gen))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight.data.copy_(_full(gen, VOCAB, HIDDEN))

    def forward(self, ids_BS):
        x = self.embed(ids_BS)
        sdpa = self._sdpa_inputs(ids_BS) if self.sdpa else None
        for blk in self.blocks:
            x = blk(x, sdpa)
        return self.head(self.norm(x))

    def _sdpa_inputs(self, ids_BS):
        """Per-sequence positions (padding, id 0, does not advance them) as rotary cos / sin, and a causal mask
        that also lowers the scores of every third token id: each sequence its own."""
        s, hd = ids_BS.shape[1], HIDDEN // HEADS
        pos_BS = (ids_BS != 0).cumsum(-1)
        freq = 1.0 / 100.0 ** (torch.arange(hd // 2, device=ids_BS.device) / (hd // 2))
        angle_BSD = (pos_BS[..., None] * freq).repeat(1, 1, 2)
        future = torch.full((s, s), float("-inf"), device=ids_BS.device).triu(1)
        mask_B1SS = future + (-2.0 * (ids_BS % 3 == 0))[:, None, None, :]
        return angle_BSD.cos()[:, None], angle_BSD.sin()[:, None], mask_B1SS


class DTensorBlock(nn.Module):
    """Written for one device; torch's `parallelize_module` shards it (Colwise up/gate, Rowwise down)."""

    def __init__(self, gen):
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN, eps=1e-5)
        self.gate, self.up = (nn.Linear(HIDDEN, INTER, bias=False) for _ in range(2))
        self.down = nn.Linear(INTER, HIDDEN, bias=False)
        with torch.no_grad():
            self.norm.weight.copy_(1 + 0.1 * torch.randn(HIDDEN, generator=gen))
            for lin in (self.gate, self.up, self.down):
                lin.weight.copy_(_full(gen, *lin.weight.shape))

    def forward(self, x):
        return x + self.down(F.silu(self.gate(self.norm(x))) * self.up(self.norm(x)))


class DTensorModel(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen))
        self.blocks = nn.ModuleList([DTensorBlock(gen) for _ in range(LAYERS)])
        self.out_norm = nn.RMSNorm(HIDDEN, eps=1e-5)

    def forward(self, ids_BS):
        x = self.embed(ids_BS)
        for block in self.blocks:
            x = block(x)
        return self.out_norm(x)

    def parallelize(self, world: int) -> DTensorModel:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        for block in self.blocks:
            parallelize_module(
                block, mesh, {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
            )
        return self


class MatmulMLPModel(nn.Module):
    """(batch, seq, hidden) activations through `x @ w.t()` MLPs on raw parameters, in-place all-reduce,
    F.rms_norm: on a graph with seq == 1 Inductor (torch 2.13) fails to lower the all-reduce of this
    pattern, so tpweave must retry the graph with the all-reduces opaque."""

    def __init__(self, rank: int, world: int, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        cols = slice(rank * INTER // world, (rank + 1) * INTER // world)
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen), requires_grad=False)
        self.w_in = nn.ParameterList(
            nn.Parameter(_full(gen, INTER, HIDDEN)[cols], requires_grad=False) for _ in range(LAYERS)
        )
        self.w_out = nn.ParameterList(
            nn.Parameter(_full(gen, HIDDEN, INTER)[:, cols], requires_grad=False) for _ in range(LAYERS)
        )
        self.norm_w = nn.Parameter(1 + 0.1 * torch.randn(LAYERS + 1, HIDDEN, generator=gen), requires_grad=False)
        self.head = nn.Parameter(_full(gen, VOCAB, HIDDEN), requires_grad=False)

    def forward(self, ids_BS):
        x = F.embedding(ids_BS, self.embed)
        for j in range(LAYERS):
            h = F.rms_norm(x, (HIDDEN,), self.norm_w[j], 1e-6)
            y = F.silu(h @ self.w_in[j].t()) @ self.w_out[j].t()
            dist.all_reduce(y)
            x = x + y
        return F.rms_norm(x, (HIDDEN,), self.norm_w[LAYERS], 1e-6) @ self.head.t()


class MoEModel(nn.Module):
    """Mixtral / Qwen-MoE blocks written as Hugging Face writes them: activations flattened with
    view(-1, hidden) (under dynamic shapes the -1 is a symbolic token count), a replicated router, top-2
    of 4 experts whose MLPs are TP-sharded (gate / up by columns, down by rows), tokens sorted by expert
    as a dispatch would, one all-reduce of the weighted expert sum. Each token also mixes in its
    predecessor in its sequence (an RWKV / Mamba token shift), an op that reads every token."""

    def __init__(self, rank: int, world: int, *, seed: int = 0, num_experts: int = 4):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        inter = slice(rank * INTER // world, (rank + 1) * INTER // world)
        param = lambda t: nn.Parameter(t.contiguous(), requires_grad=False)  # noqa: E731
        self.num_experts = num_experts
        self.embed = param(torch.randn(VOCAB, HIDDEN, generator=gen))
        self.norm_w = param(1 + 0.1 * torch.randn(LAYERS + 1, HIDDEN, generator=gen))
        self.router = param(_full(gen, LAYERS, num_experts, HIDDEN))
        self.w_gate = param(_full(gen, LAYERS, num_experts, INTER, HIDDEN)[:, :, inter])
        self.w_up = param(_full(gen, LAYERS, num_experts, INTER, HIDDEN)[:, :, inter])
        self.w_down = param(_full(gen, LAYERS, num_experts, HIDDEN, INTER)[..., inter])
        self.head = param(_full(gen, VOCAB, HIDDEN))

    def forward(self, ids_BS):
        b, s = ids_BS.shape
        x = F.embedding(ids_BS, self.embed)
        for i in range(LAYERS):
            h_BSH = F.rms_norm(x, (HIDDEN,), self.norm_w[i], 1e-6)
            prev_BSH = F.pad(h_BSH, (0, 0, 1, 0))[:, :-1]  # each token's predecessor in its sequence (zeros first)
            h = h_BSH.view(-1, HIDDEN)
            probs = (h @ self.router[i].t()).softmax(-1)
            top_w, top_e = probs.topk(2, dim=-1)
            combine = torch.zeros_like(probs).scatter(-1, top_e, top_w / top_w.sum(-1, keepdim=True))
            order = top_e[:, 0].argsort(stable=True)
            h_in = h[order] + 0.5 * prev_BSH.reshape(-1, HIDDEN)[order]
            y = 0
            for e in range(self.num_experts):
                act = F.silu(h_in @ self.w_gate[i, e].t()) * (h_in @ self.w_up[i, e].t())
                y = y + combine[order, e : e + 1] * (act @ self.w_down[i, e].t())
            y = y[order.argsort()]
            dist.all_reduce(y)
            x = x + y.view(b, s, HIDDEN)
        return F.rms_norm(x, (HIDDEN,), self.norm_w[LAYERS], 1e-6) @ self.head.t()
