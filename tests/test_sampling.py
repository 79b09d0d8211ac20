"""Batched sampling on the logits' device: greedy, temperature and top-p, the draw of a request a function
of its seed and its generated-token count only (not of the batch), the distribution the right one."""

from __future__ import annotations

import torch

from tpweave.engine.sampling import request_seed, sample, uniform_noise


def test_noise_depends_on_the_seed_alone():
    seeds = torch.tensor([request_seed(s, n) for s, n in ((0, 0), (0, 1), (1, 0), (7, 3))])
    noise = uniform_noise(seeds, 1000)
    assert noise.shape == (4, 1000) and 0 < noise.min() and noise.max() < 1
    assert torch.equal(noise[3], uniform_noise(seeds[3:], 1000)[0])  # the same row alone or in a batch
    assert len({tuple(r.tolist()[:8]) for r in noise}) == 4  # different seeds, different noise
    assert abs(noise.mean().item() - 0.5) < 0.02


def test_a_mixed_batch_draws_each_row_as_it_would_alone():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3, 0.9])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 1e-6])
    seeds = torch.tensor([request_seed(i, 5) for i in range(6)])
    batched = sample(logits, temperature, top_p, seeds)
    alone = [
        sample(logits[i : i + 1], temperature[i : i + 1], top_p[i : i + 1], seeds[i : i + 1]).item() for i in range(6)
    ]
    assert batched.tolist() == alone
    greedy = logits.argmax(-1)
    assert batched[0] == greedy[0] and batched[3] == greedy[3] and batched[5] == greedy[5]  # T=0, and top_p ~ 0
    assert torch.equal(sample(logits, temperature, top_p, seeds, any_random=False), greedy)


def test_draws_follow_the_tempered_top_p_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(40000, 1)
    seeds = torch.tensor([request_seed(s, 0) for s in range(40000)])
    ones = torch.ones(40000)
    freq = torch.bincount(sample(logits, 2 * ones, ones, seeds), minlength=4) / 40000
    torch.testing.assert_close(freq, torch.softmax(logits[0] / 2, 0), atol=0.01, rtol=0)
    # top_p = 0.7 at temperature 1: probabilities 0.64, 0.24, ...: the two most likely tokens, renormalized
    freq = torch.bincount(sample(logits, ones, 0.7 * ones, seeds), minlength=4) / 40000
    p = torch.softmax(logits[0], 0)
    torch.testing.assert_close(
        freq, torch.tensor([0, 0, p[2] / (p[2] + p[3]), p[3] / (p[2] + p[3])]), atol=0.01, rtol=0
    )


def test_sequences_compare_by_identity():
    """The scheduler's membership tests and removals must not compare token lists (they did: O(tokens)
    per comparison, O(n^2) comparisons per step)."""
    from tpweave.engine import Sequence

    a, b = Sequence([1, 2, 3]), Sequence([1, 2, 3])
    assert a != b and a in [a] and b not in [a]
    a.output_token_ids += [4, 5]
    assert (
        a.tokens(1, 5) == [2, 3, 4, 5] and a.token_at(4) == 5 and a.tokens(3, 5) == [4, 5] and a.tokens(0, 2) == [1, 2]
    )
