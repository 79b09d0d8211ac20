"""More TP model styles for the compiler: post-norm, parallel attention+MLP, Gemma-like norms and
scaled embeddings, fused residual that returns (normed, residual), last-token LM head, funcol
all_reduce, several outputs, GPT-2-like row-parallel bias after the reduction with a scaled residual.
Each is small; weights come from a seed and are sliced by rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F
from torch import nn

H, I, V = 32, 64, 40


def _rand(gen, *shape):
    return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5


class StyleModel(nn.Module):
    def __init__(self, rank: int, world: int, style: str, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.style, self.world = style, world
        cols = slice(rank * I // world, (rank + 1) * I // world)
        self.embed = nn.Parameter(torch.randn(V, H, generator=gen), requires_grad=False)
        self.w_in = nn.ParameterList([nn.Parameter(_rand(gen, I, H)[cols], requires_grad=False) for _ in range(2)])
        self.w_out = nn.ParameterList([nn.Parameter(_rand(gen, H, I)[:, cols], requires_grad=False) for _ in range(2)])
        self.norm_w = nn.Parameter(0.1 * torch.randn(3, H, generator=gen), requires_grad=False)
        self.head = nn.Parameter(_rand(gen, V, H), requires_grad=False)
        self.b_out = nn.Parameter(0.1 * torch.randn(2, H, generator=gen), requires_grad=False)  # row-parallel bias

    def _reduce(self, y):
        if self.style == "funcol":
            return fc.all_reduce(y, "sum", dist.group.WORLD)
        if self.style == "async_op":  # Dynamo traces no graph of this forward (torch 2.13)
            dist.all_reduce(y, async_op=True).wait()
            return y
        dist.all_reduce(y)
        return y

    def _norm(self, x, i):
        if self.style == "gemma":  # (1 + w), computed in fp32, eps inside the sqrt
            x32 = x.float()
            return (
                x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.norm_w[i].float())
            ).type_as(x)
        if self.style in ("postnorm", "row_bias"):
            return F.layer_norm(x, (H,), 1 + self.norm_w[i], 0.1 * self.norm_w[i], 1e-5)
        return F.rms_norm(x, (H,), 1 + self.norm_w[i], 1e-6)

    def _mlp(self, x, j):
        return self._reduce(F.gelu(x @ self.w_in[j].t()) @ self.w_out[j].t())

    def forward(self, ids):
        x = F.embedding(ids, self.embed)
        if self.style == "gemma":
            x = x * (H**0.5)
        if self.style == "postnorm":
            for j in range(2):
                x = self._norm(x + self._mlp(x, j), j)
        elif self.style == "parallel":  # one all-reduce for the sum of both branches (GPT-J)
            h = self._norm(x, 0)
            partial = (
                F.gelu(h @ self.w_in[0].t()) @ self.w_out[0].t() + F.silu(h @ self.w_in[1].t()) @ self.w_out[1].t()
            )
            x = x + self._reduce(partial)
        elif self.style == "fused_residual":  # vLLM style: norm(x, residual) -> (normed, new residual)
            residual = x
            h = self._norm(x, 0)
            for j in range(2):
                out = self._mlp(h, j)
                residual = out + residual
                h = self._norm(residual, j + 1)
            return h[-1:] @ self.head.t(), residual  # last-token logits and the residual stream
        elif (
            self.style == "row_bias"
        ):  # GPT-2 / OPT: pre-LayerNorm, bias added once after the reduction, scaled residual
            for j in range(2):
                x = 0.5 * x + (self._mlp(self._norm(x, j), j) + self.b_out[j])
        elif self.style == "graph_break":  # not in STYLES: Dynamo compiles two graphs (as at HF's SDPA call)
            x = x + self._mlp(self._norm(x, 0), 0)
            torch._dynamo.graph_break()
            x = x + self._mlp(self._norm(x, 1), 1)
        else:
            for j in range(2):
                x = x + self._mlp(self._norm(x, j), j)
        return self._norm(x, 2) @ self.head.t()


STYLES = ["postnorm", "parallel", "gemma", "fused_residual", "funcol", "row_bias"]
