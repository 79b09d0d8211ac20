"""Batched sampling on the logits' device: greedy, temperature and top-p for every row in one pass.

Randomness is counter-based: the uniform noise of row b and vocabulary entry v is a hash of
(seed_b, v), so a request's draw depends only on its own seed and how many tokens it has generated,
never on the batch it shares a step with, and every TP rank draws the same token without
communicating. Sampling is the Gumbel-max trick over the top-p-masked log-probabilities:
argmax(log p + g) with g = -log(-log(u)) is a draw from p.
"""

from __future__ import annotations

import torch
from torch import Tensor

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB


def _srl(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: Tensor) -> Tensor:
    """The splitmix64 finalizer on int64 tensors (wrapping arithmetic): a well-mixed 64-bit hash."""
    x = x + _GOLDEN
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


def uniform_noise(seeds: Tensor, vocab_size: int) -> Tensor:
    """(B, V) uniforms in (0, 1), float32: a function of (seeds[b], v) alone. seeds: (B,) int64."""
    v = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _splitmix64(_splitmix64(seeds[:, None]) ^ v[None, :])
    return (_srl(bits, 40).to(torch.float32) + 0.5) * 2.0**-24  # 24 random bits: exact in float32


def request_seed(seed: int, num_generated: int) -> int:
    """The seed of a request's next draw: its own seed and the count of tokens it has generated
    (stable under preemption and batching), folded into a signed 64-bit integer."""
    x = (seed * 0x9E3779B1 + num_generated * 0x85EBCA77 + 0x165667B1) & (2**64 - 1)
    return x - 2**64 if x >= 2**63 else x


def sample(logits: Tensor, temperature: Tensor, top_p: Tensor, seeds: Tensor, *, any_random: bool = True) -> Tensor:
    """Next token of every row: logits (B, V) float32; temperature, top_p (B,) float32 (temperature 0:
    greedy); seeds (B,) int64, all on the logits' device. any_random=False (the caller knows no row has a
    temperature): greedy only. Returns (B,) int64 on the logits' device; nothing waits for the GPU."""
    greedy = logits.argmax(-1)
    if not any_random:
        return greedy
    t = torch.where(temperature > 0, temperature, 1.0)[:, None]
    logp = torch.log_softmax(logits / t, dim=-1)
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    probs = sorted_logp.exp()
    keep = probs.cumsum(-1) - probs < top_p[:, None]  # the smallest prefix with mass >= top_p
    masked = torch.full_like(logp, float("-inf")).scatter(-1, order, torch.where(keep, sorted_logp, float("-inf")))
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, logits.shape[-1])))
    drawn = (masked + gumbel).argmax(-1)
    return torch.where(temperature > 0, drawn, greedy)
