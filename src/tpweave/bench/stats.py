"""Ratios of timed arms with 95% confidence intervals, the A/A check, and what a ratio may be called.

Samples of two arms are paired by repetition: in repetition i every arm ran once, in a shuffled order,
so sample i of arm A and sample i of arm B saw the same machine state. The interval of
median(A) / median(B) comes from a paired bootstrap over repetitions (resample repetition indices,
recompute both medians), the percentile method, a fixed seed. A ratio whose interval holds 1.0 is
"no significant difference", never a win or a loss.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 4000


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


def paired_ratio(base_ms: list[float], arm_ms: list[float], *, seed: int = 0) -> Ratio:
    """median(base) / median(arm) and its paired-bootstrap 95% interval (samples paired by repetition)."""
    base, arm = np.asarray(base_ms, dtype=float), np.asarray(arm_ms, dtype=float)
    if base.shape != arm.shape or base.ndim != 1 or len(base) == 0:
        raise ValueError(f"paired samples need equal non-empty lengths, got {len(base_ms)} and {len(arm_ms)}")
    ratio = float(np.median(base) / np.median(arm))
    if len(base) < 3:  # no interval worth the name: as wide as possible, never significant
        return Ratio(ratio, 0.0, float("inf"), len(base))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(base), size=(BOOTSTRAP_RESAMPLES, len(base)))
    boots = np.median(base[idx], axis=1) / np.median(arm[idx], axis=1)
    tail = (1 - CONFIDENCE) / 2 * 100
    lo, hi = np.percentile(boots, [tail, 100 - tail])
    return Ratio(ratio, float(lo), float(hi), len(base))


def aa_check(first_ms: list[float], second_ms: list[float], *, seed: int = 0) -> dict:
    """The A/A control: two independently captured copies of one arm. Its ratio and interval, and
    `flagged` when the interval excludes 1.0 (the run's noise or a bias in the harness is then larger
    than the gains it can resolve)."""
    r = paired_ratio(first_ms, second_ms, seed=seed)
    return {**r.to_dict(), "flagged": r.significant, "half_width": (r.hi - r.lo) / 2}


def median(samples: list[float]) -> float:
    """The median of the samples."""
    return float(np.median(np.asarray(samples, dtype=float)))
