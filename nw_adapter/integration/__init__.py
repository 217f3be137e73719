"""The diffusers integration: observe or swap IP-Adapter's image-branch attention.

- :mod:`~nw_adapter.integration.families`: the family registry, one row per model family (UNet,
  SD 3, Flux) and per embedded tiny model: which family a pipeline, denoiser or processor is;
- :mod:`~nw_adapter.integration.config`: :class:`NWProcessorConfig`, every option validated;
- :mod:`~nw_adapter.integration.processors`: the attention processors (shared side
  computation + one module per model family);
- :mod:`~nw_adapter.integration.recorder`: the streaming :class:`NWRecorder` (its records as
  plain dicts), with the record field names in :mod:`~nw_adapter.integration.schema`; its
  summaries, tables, files and figures are the analysis layer's (:mod:`nw_adapter.analysis`);
- :mod:`~nw_adapter.integration.schedules`: the noise level (alpha, sigma, h) of a step;
- :mod:`~nw_adapter.integration.mixin`: ``apply_nw_processor`` / ``remove_nw_processor`` /
  the ``nw_processor`` context manager and the pipeline mixin.

May import: the math layer (:mod:`nw_adapter.core`), :mod:`nw_adapter.atomic`, torch,
diffusers. Never matplotlib, the correlate application or the experiments; the analysis layer
only inside :class:`NWRecorder`'s report methods (:mod:`~nw_adapter.integration.reports`,
imported when called); prints nothing and
never exits (``tests/test_layering.py`` enforces the imports).
"""
