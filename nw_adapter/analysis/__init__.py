"""Analysis and reporting of what the integration records, and the checks of the files it reads back.

Between :mod:`nw_adapter.integration` (which records) and :mod:`nw_adapter.correlate` (the
command line, which prints):

- :mod:`~nw_adapter.analysis.records`: :class:`~nw_adapter.analysis.records.Records`, the records
  of a run, and everything derived from them (aggregation, summary table, CSV, dataframe, the rho
  figure); what ``NWRecorder.records()`` / ``summary()`` / ``to_csv()`` / ``plot()`` return;
- :mod:`~nw_adapter.analysis.records_file`: the records file of ``NWRecorder.to_json`` /
  ``NWRecorder.from_json`` (also reads the command line's ``rho.json``);
- :mod:`~nw_adapter.analysis.validation`: record-by-record checks of every file read back;
- :mod:`~nw_adapter.analysis.heatmaps`: per-image-token heat maps of the stored maps
  (``NWRecorder.heat_maps()``);
- :mod:`~nw_adapter.analysis.consequence`: ``compare_swap``, stock against swap generations,
  with intervals and the conclusion.
- :mod:`~nw_adapter.analysis.support_sets`: ``observe_support_set``, one generation on a support set
  (several references for one adapter) observed, with its per-step attention masses per reference
  beside the theory's posterior over the references' latents, and which reference the image
  resembles (the generated latent's nearest, CLIP-I, a class judge);
- :mod:`~nw_adapter.analysis.plug_in_outcomes`: the learned adapter against the plug-in NW field
  (and its smoothed variant) by outcome over support sets: class kept, diversity, copy distance.

May import: :mod:`nw_adapter.integration`, :mod:`nw_adapter.core`, :mod:`nw_adapter.atomic`,
torch, numpy, scipy, PIL, pandas and matplotlib (the last five inside the functions that need
them). Never the correlate application, the experiments, the models or the pipelines; prints
nothing and never exits. :class:`~nw_adapter.integration.recorder.NWRecorder`'s user-facing
report methods import this layer inside the method (``tests/test_layering.py``), so the
integration layer and its processors load neither this layer nor matplotlib.
"""
