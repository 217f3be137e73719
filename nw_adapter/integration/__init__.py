"""The diffusers integration: observe or swap IP-Adapter's image-branch attention.

- :mod:`~nw_adapter.integration.config`: :class:`NWProcessorConfig`, every option validated;
- :mod:`~nw_adapter.integration.processors`: the attention processors (shared side
  computation + one module per model family);
- :mod:`~nw_adapter.integration.recorder`: the streaming :class:`NWRecorder` and its exports,
  with the record field names in :mod:`~nw_adapter.integration.schema`;
- :mod:`~nw_adapter.integration.schedules`: the noise level (alpha, sigma, h) of a step;
- :mod:`~nw_adapter.integration.mixin`: ``apply_nw_processor`` / ``remove_nw_processor`` /
  the ``nw_processor`` context manager and the pipeline mixin.

May import: the math layer (:mod:`nw_adapter.core`), :mod:`nw_adapter.atomic`, torch,
diffusers. Never the correlate application or the experiments; prints nothing and never
exits (``tests/test_layering.py`` enforces the imports).
"""
