"""Packed batches of token ids: the input format of every model and engine step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PackedBatch:
    """Token ids (M,), positions within their sequence (M,), and cu_seqlens (B + 1,) int32: sequence b spans
    rows cu_seqlens[b]:cu_seqlens[b + 1]."""

    input_ids: Tensor  # (M,) int64
    positions: Tensor  # (M,) int64, position of each token within its sequence
    cu_seqlens: Tensor  # (B + 1,) int32, sequence b spans rows cu_seqlens[b]:cu_seqlens[b + 1]

    @property
    def num_tokens(self) -> int:
        """M, the tokens of all sequences together."""
        return self.input_ids.shape[0]

    def args(self) -> tuple[Tensor, Tensor, Tensor]:
        """(input_ids, positions, cu_seqlens): the model's positional arguments."""
        return self.input_ids, self.positions, self.cu_seqlens


def split_tokens(num_tokens: int, num_seqs: int) -> list[int]:
    """Split M tokens into up to `num_seqs` sequences of near-equal length (no empty ones)."""
    if num_tokens < 1:
        raise ValueError(f"a batch needs at least one token, got {num_tokens}")
    num_seqs = max(1, min(num_seqs, num_tokens))
    base, extra = divmod(num_tokens, num_seqs)
    return [base + (i < extra) for i in range(num_seqs)]


def pack(sequences: list[Tensor], *, device: str | torch.device | None = None) -> PackedBatch:
    """The given token-id sequences (each (L_b,) int64) packed in order; ValueError for none or an empty one."""
    if not sequences or any(len(s) < 1 for s in sequences):
        raise ValueError(f"every sequence needs at least one token, got lengths {[len(s) for s in sequences]}")
    lens = torch.tensor([len(s) for s in sequences])
    ids = torch.cat(list(sequences))
    positions = torch.cat([torch.arange(len(s)) for s in sequences])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)
    device = device if device is not None else ids.device
    return PackedBatch(ids.to(device), positions.to(device), cu.to(device))


def random_batch(
    seq_lens: list[int], *, vocab_size: int, seed: int = 0, device: str | torch.device = "cpu"
) -> PackedBatch:
    """A packed batch of sequences of the given lengths, random ids in [0, vocab_size) from `seed`, on
    `device`; ValueError for no sequence or an empty one."""
    if not seq_lens or any(n < 1 for n in seq_lens):
        raise ValueError(f"every sequence needs at least one token, got lengths {seq_lens}")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (sum(seq_lens),), generator=gen)
    return pack(list(ids.split(seq_lens)), device=device)
