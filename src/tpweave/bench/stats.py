"""Ratios of timed arms with 95% confidence intervals, the A/A check, and what a ratio may be called.

Samples of two arms are paired by repetition: in repetition i every arm ran once, in a shuffled order,
so sample i of arm A and sample i of arm B saw the same machine state. The interval of
median(A) / median(B) comes from a paired bootstrap over repetitions (resample repetition indices,
recompute both medians), the percentile method, a fixed seed. Where each arm was captured in several CUDA
graphs and repetition i replayed capture `groups[i]` (two captures of one graph differ by more than the
repetitions of one capture), the bootstrap is hierarchical: resample the captures, then the repetitions
within each, so the interval covers capture-to-capture variation too. A ratio whose interval holds 1.0 is
"no significant difference", never a win or a loss.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 4000
# the verdict of a significant ratio inside the A/A control's spread (bench/arms.py): no difference the run resolves
AA_NOISE = "within the A/A control's noise"


@dataclass(frozen=True)
class Ratio:
    """median(base) / median(arm): > 1 means `arm` is faster than `base`; lo..hi its 95% interval."""

    ratio: float
    lo: float
    hi: float
    n: int  # paired repetitions

    @property
    def significant(self) -> bool:
        """Whether the interval excludes 1.0."""
        return self.lo > 1.0 or self.hi < 1.0

    @property
    def verdict(self) -> str:
        """'faster', 'slower' or 'no significant difference' (of `arm` against `base`)."""
        if not self.significant:
            return "no significant difference"
        return "faster" if self.lo > 1.0 else "slower"

    def text(self) -> str:
        """'1.043x [1.031, 1.055]', or when the interval holds 1.0 '1.004x [0.991, 1.017] no significant
        difference'."""
        core = f"{self.ratio:.3f}x [{self.lo:.3f}, {self.hi:.3f}]"
        return core if self.significant else f"{core} no significant difference"

    def to_dict(self) -> dict:
        """JSON-ready fields, with the verdict."""
        return {**asdict(self), "verdict": self.verdict}


def _resample(groups: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(BOOTSTRAP_RESAMPLES, n) repetition indices: per resample the groups drawn with replacement, then within
    each drawn group its repetitions drawn with replacement (n indices in all, the groups' sizes kept)."""
    n = len(groups)
    members = [np.flatnonzero(groups == g) for g in np.unique(groups)]
    out = np.empty((BOOTSTRAP_RESAMPLES, n), dtype=np.int64)
    for b in range(BOOTSTRAP_RESAMPLES):
        picked = rng.integers(0, len(members), size=len(members))
        parts = [members[g][rng.integers(0, len(members[g]), size=len(members[g]))] for g in picked]
        row = np.concatenate(parts)
        out[b] = row[:n] if len(row) >= n else np.resize(row, n)
    return out


def paired_ratio(base_ms: list[float], arm_ms: list[float], *, seed: int = 0, groups: list[int] | None = None) -> Ratio:
    """median(base) / median(arm) and its paired-bootstrap 95% interval (samples paired by repetition; with
    `groups`, the capture each repetition replayed: hierarchical, captures then repetitions)."""
    base, arm = np.asarray(base_ms, dtype=float), np.asarray(arm_ms, dtype=float)
    if base.shape != arm.shape or base.ndim != 1 or len(base) == 0:
        raise ValueError(f"paired samples need equal non-empty lengths, got {len(base_ms)} and {len(arm_ms)}")
    if groups is not None and len(groups) != len(base):
        raise ValueError(f"groups needs one capture index per repetition, got {len(groups)} for {len(base)}")
    ratio = float(np.median(base) / np.median(arm))
    if len(base) < 3:  # no interval worth the name: as wide as possible, never significant
        return Ratio(ratio, 0.0, float("inf"), len(base))
    rng = np.random.default_rng(seed)
    if groups is not None and len(set(groups)) > 1:
        idx = _resample(np.asarray(groups), rng)
    else:
        idx = rng.integers(0, len(base), size=(BOOTSTRAP_RESAMPLES, len(base)))
    boots = np.median(base[idx], axis=1) / np.median(arm[idx], axis=1)
    tail = (1 - CONFIDENCE) / 2 * 100
    lo, hi = np.percentile(boots, [tail, 100 - tail])
    return Ratio(ratio, float(lo), float(hi), len(base))


def aa_check(first_ms: list[float], second_ms: list[float], *, seed: int = 0, groups: list[int] | None = None) -> dict:
    """The A/A control: two independently captured copies of one arm. Its ratio and interval (hierarchical
    with `groups`, as paired_ratio), and `flagged` when the interval excludes 1.0 (the run's noise or a bias in
    the harness is then larger than the gains it can resolve)."""
    r = paired_ratio(first_ms, second_ms, seed=seed, groups=groups)
    return {**r.to_dict(), "flagged": r.significant, "half_width": (r.hi - r.lo) / 2}


def within_aa_noise(row: dict, aa: dict | None) -> None:
    """The A/A control as the yardstick: in `row`, a significant vs_plain_best / vs_plain_nccl ratio no further from
    1.0 than the A/A interval's half-width (two captures of one arm differ that much) gets the verdict AA_NOISE
    instead of faster / slower. Nothing without a control."""
    if aa is None:
        return
    for base in ("plain_best", "plain_nccl"):
        v = row.get(f"vs_{base}")
        if v and v.get("verdict") in ("faster", "slower") and abs(v["ratio"] - 1.0) <= aa["half_width"]:
            v["verdict"] = AA_NOISE


def median(samples: list[float]) -> float:
    """The median of the samples."""
    return float(np.median(np.asarray(samples, dtype=float)))
