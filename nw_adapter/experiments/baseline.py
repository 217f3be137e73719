"""When a learned model is a fair baseline, and when it has converged (one meaning each).

- **fair baseline**: on its own training distribution the learned model is at least as good as
  the training-free plug-in NW field, up to a margin: the 95% Fieller interval of its relative
  MMD^2 excess ``mean(learned) / mean(plug-in) - 1`` over the independent units has its upper end
  below :data:`FAIR_MARGIN` (a one-sided non-inferiority test at 2.5%). It fails when the learned
  model is worse, and also when the units cannot tell (a wide interval): it cannot pass by a
  failure to reject. Where a learned model is not a fair baseline the report draws no conclusion
  from it.
- **converged**: :func:`nw_adapter.experiments.training.loss_plateau` (the held-out training loss's
  fitted decrease over the last 20% of steps is below 2% of the loss, with 95% confidence).

Both are decided here and nowhere else; the report uses these two words only in these meanings.
"""

from __future__ import annotations

import math

from nw_adapter.experiments.inference import fieller_interval, unit_values

__all__ = ["FAIR_MARGIN", "fair_baseline"]

#: The learned model may be at most this much worse than the plug-in (relative MMD^2) to be fair.
FAIR_MARGIN = 0.10


def fair_baseline(plugin, learned, *, clusters=None, margin: float = FAIR_MARGIN) -> dict:
    """Non-inferiority of a learned model to the plug-in on the same tasks.

    Args:
        plugin: ``[tasks]`` plug-in MMD^2.
        learned: ``[seeds, tasks]`` (or ``[tasks]``) learned MMD^2 on the same tasks.
        clusters: Optional class label per task (units on features).
        margin: Allowed relative excess.

    Returns:
        ``{"fair", "excess" (mean(learned) / mean(plug-in) - 1), "excess_ci", "margin", "units"}``.
    """
    p, x = unit_values(plugin, clusters), unit_values(learned, clusters)
    lo, hi = fieller_interval(x, p)
    excess = float(x.mean() / p.mean() - 1.0) if p.mean() > 0 else math.nan
    return {
        "fair": bool(math.isfinite(hi) and hi - 1.0 < margin),
        "excess": excess,
        "excess_ci": [float(lo) - 1.0, float(hi) - 1.0],
        "margin": margin,
        "units": int(p.size),
    }
