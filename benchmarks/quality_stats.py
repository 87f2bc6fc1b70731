"""Confidence intervals for ``bench_quality.py``: the percentile bootstrap over positions or instances (seeded, so a
run's intervals repeat), paired where two rows are compared on the same items, and Wilson's score interval for a
share of right answers.

An :class:`Estimate` is a value and its interval; every figure of the quality tables is one.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Callable

import torch

#: Bootstrap index matrices hold at most this many entries at once (resamples are drawn in slices).
_MAX_DRAW = 1 << 22


@dataclass(frozen=True)
class Estimate:
    """A figure and its confidence interval ``[low, high]``."""

    value: float
    low: float
    high: float

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Estimate":
        return cls(*(float("nan") if data[key] is None else float(data[key]) for key in ("value", "low", "high")))

    def scaled(self, factor: float) -> "Estimate":
        """The same estimate in other units (``100``: a share in points)."""
        return Estimate(self.value * factor, self.low * factor, self.high * factor)


def bootstrap(values: torch.Tensor, resamples: int = 1000, confidence: float = 0.95, seed: int = 0,
              transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Estimate:
    """The mean of ``values`` (1-D, one per position or instance) and its percentile-bootstrap interval:
    ``resamples`` resamples of the items with replacement, drawn from ``seed``, the interval the central
    ``confidence`` of their means. ``transform`` maps means to the reported figure (``torch.exp``: a perplexity
    from mean negative log-likelihoods), applied to the value and to both ends.

    Paired comparisons pass per-item differences (two rows on the same items): the same ``seed`` and item count
    draw the same resamples for every row, so rows are compared on common resamples. One item, or items all
    equal, give an interval of width 0."""
    values = torch.as_tensor(values).detach().double().flatten().cpu()
    if values.numel() == 0:
        raise ValueError("no values to bootstrap")
    if resamples < 1 or not 0.0 < confidence < 1.0:
        raise ValueError(f"resamples >= 1 and confidence in (0, 1) expected, got {resamples} and {confidence}")
    count = values.numel()
    generator = torch.Generator().manual_seed(seed)
    means = []
    step = max(1, _MAX_DRAW // count)
    for start in range(0, resamples, step):
        draws = min(step, resamples - start)
        means.append(values[torch.randint(0, count, (draws, count), generator=generator)].mean(1))
    means = torch.cat(means)
    tail = (1.0 - confidence) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1.0 - tail], dtype=means.dtype))
    mean = values.mean()
    if transform is not None:
        mean, low, high = (transform(x) for x in (mean, low, high))
    # A mean of equal values can round a hair outside its resamples' range: the interval holds the value.
    return Estimate(float(mean), min(float(low), float(mean)), max(float(high), float(mean)))


def wilson(share: float, count: int, confidence: float = 0.95) -> Estimate:
    """``share`` of ``count`` trials and Wilson's score interval. For scores in [0, 1] that are not all 0 or 1 (a
    share of answers' parts) the interval is conservative: their variance is at most ``share * (1 - share)``,
    the binomial variance the interval assumes."""
    if count < 1:
        raise ValueError("Wilson's interval needs at least one trial")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"a share in [0, 1] expected, got {share}")
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    centre = (share + z * z / (2 * count)) / (1 + z * z / count)
    half = z / (1 + z * z / count) * math.sqrt(share * (1 - share) / count + z * z / (4 * count * count))
    return Estimate(share, max(0.0, centre - half), min(1.0, centre + half))
