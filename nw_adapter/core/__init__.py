"""The math layer: Nadaraya-Watson kernel smoothing as flow matching, in pure torch.

- :mod:`~nw_adapter.core.kernels`: NW weights and means, Gaussian-kernel attention through
  ``scaled_dot_product_attention``, effective sample size;
- :mod:`~nw_adapter.core.bandwidth`: matched / fitted / median / schedule bandwidth rules;
- :mod:`~nw_adapter.core.paths`: probability paths (OT, rectified flow, constant noise, VP,
  sigma flow) and :class:`~nw_adapter.core.paths.NWVelocityField`;
- :mod:`~nw_adapter.core.smoothed_fields`: training-free fields exact for smoothed targets (smoothed
  support, local covariance / manifold Parzen, projected NW), one per lesson of THEORY.md 5;
- :mod:`~nw_adapter.core.sampling`: time grids and ODE samplers;
- :mod:`~nw_adapter.core.metrics`: rank and divergence statistics, nulls, MMD^2;
- :mod:`~nw_adapter.core.readings`: key-prior vs NW-smoother readings of one head (r2_key, r2_nw,
  kl_nw_fit, kl_key_prior, nw_gain, h_eff);
- :mod:`~nw_adapter.core.specification`: the one specification of every recorded statistic (the
  names table, one plain function each, the nulls' random numbers, h_eff's reasons);
- :mod:`~nw_adapter.core.compare`: :func:`~nw_adapter.core.compare.compare_attention`, every
  reading of any attention head from its q and k (the public reference);
- :mod:`~nw_adapter.core.intervals`: Student t intervals and one-sided t tests over independent
  units (reference images), for the verdict and the swap consequence.

May import: torch (and the standard library); :mod:`~nw_adapter.core.intervals` numpy and scipy
(no torch, so reports rebuild from saved files without it). Never diffusers, transformers, PIL or
matplotlib (``tests/test_layering.py`` enforces it).
"""
