"""Confidence-scheduled verification (DSpark, DeepSeek DeepSpec, Algorithm 1 for one request): how many of a
block's drafts to send to the target, from the drafter's per-position confidences.

With confidences c_1..c_g (c_j estimates P(x_j accepted | x_1..x_{j-1} accepted)), the survival
a_j = prod_{i<=j} c_i and the expected committed tokens of verifying j drafts E(j) = 1 + a_1 + ... + a_j.
The objective is E(j) / verify(j + 1): committed tokens per second of a verify forward of width j + 1
(a measured CostCurve, seconds). Positions are admitted in order and the scan stops at the first one that
does not improve the objective. The early break matters for losslessness: whether x_j is verified then
depends only on c_1..c_j, which the drafter computes before drawing x_j, so the cut is a stopping rule and
rejection sampling stays exact; a global argmax over j would look at c_{j+1} (a function of x_j) and bias
the output.

Threshold mode: keep drafts while a_j >= threshold.
"""

from dataclasses import dataclass
from typing import Optional, Sequence

from .cost import CostCurve


def verify_length(confidence: Sequence[float], curve: Optional[CostCurve] = None,
                  threshold: Optional[float] = None) -> int:
    """Drafts to verify, 0..len(confidence).

    Args:
        confidence: c_1..c_g, floats in [0, 1].
        curve: CostCurve (seconds per verify forward of a width); used when given.
        threshold: survival threshold in [0, 1]; used when no curve is given.

    Returns:
        j: verify the first j drafts. All of them when neither curve nor threshold is given.
    """
    survive, expected, keep = 1.0, 1.0, 0
    best = expected / curve(1) if curve is not None else None
    for j, c in enumerate(confidence, start=1):
        survive *= float(c)
        if curve is not None:
            rate = (expected + survive) / curve(j + 1)
            if rate <= best:
                break
            best = rate
        elif threshold is not None and survive < threshold:
            break
        expected += survive
        keep = j
    return keep


@dataclass
class ConfidenceSchedule:
    """A verify-length rule: `curve` (Algorithm 1 with the early break), else `threshold`, else keep all.

    Attributes:
        curve: CostCurve of the target, or None.
        threshold: survival threshold, or None.
    """

    curve: Optional[CostCurve] = None
    threshold: Optional[float] = None

    def __call__(self, confidence: Sequence[float]) -> int:
        return verify_length(confidence, self.curve, self.threshold)
