"""Synthetic and real-feature experiments of the paper (THEORY.md section 5).

Modules:

- ``tasks``: task families (anisotropic Gaussian mixtures, concentric shells, the 2-D mixed
  family, real features split by class) producing :class:`tasks.TaskBatch` (support, targets, mask).
- ``model``: the learned in-context flow-matching model (cross-attention to the support, optional
  frozen exact NW head), with access to its attention weights.
- ``training``: flow-matching training on fresh tasks, resumable safetensors checkpoints.
- ``fields``: plug-in NW field, exact NW velocity and model fields for the ODE sampler.
- ``evaluation``: Euler sampling, unbiased MMD^2, n_eff, benefit and paired tests.
- ``heads``: the learned heads analysed like IP-Adapter's (rho against NW weights across t).
- ``scale``, ``units``, ``runner``, ``report``, ``cli``: the failure-regime experiments
  (``scripts/run_experiments.py``), see docs/experiments.md.

May import: the math layer (:mod:`nw_adapter.core`), :mod:`nw_adapter.atomic`, torch, numpy,
scipy, scikit-learn, matplotlib; never diffusers or the correlate application.
"""
