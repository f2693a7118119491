"""What replay's tolerances are: :class:`ComparisonConfig`, one frozen dataclass whose defaults
are what ``taichi-plan replay`` judges the planned run's training by (:mod:`.compare`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ComparisonConfig:
    """How :func:`~.compare.compare_training` and :func:`~.compare.statistical_check` judge
    whether the planned run trains as the unplanned one: each field with what it tunes and its
    unit.

    Chunks sum in another order: gradients differ by rounding, compared element by element on
    the first planned step (both runs start it from the same parameters: the warm-up is
    unplanned). Parameters are compared as a whole: AdamW's update g / (sqrt(v) + eps) turns a
    rounding-sized difference in a near-zero gradient into an update difference of up to its
    learning rate, so a few elements leave any element-wise tolerance while the rest agree to
    rounding (an OPT decoder's head over tokens: 66 elements outside allclose after 5 steps, the
    parameters' relative L2 distance 1.0e-6)."""

    # Relative tolerance of ``torch.allclose`` on each first planned step's gradient (a ratio).
    grad_rtol: float = 1e-4
    # Absolute tolerance of that ``allclose``, also added to the low-precision rounding bound
    # (in the gradients' own units).
    grad_atol: float = 1e-6
    # The most relative L2 distance (a ratio) of all parameters after the first planned step
    # (a low-precision rounding bound raises it where that is larger).
    params_rel_tol: float = 1e-5
    # A first-step gradient element whose two runs disagree by more than this share of its
    # value (a ratio) is rounding noise, left out of the parameters' distance (the gradient
    # check has bounded the disagreement absolutely).
    noise_share: float = 1e-2
    # Per-chunk dropout: the planned-vs-unplanned distance may be at most this many times (a
    # factor) the reseeded-vs-unplanned one.
    stat_factor: float = 2.0
