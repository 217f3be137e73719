"""The ``correlate`` application: rho across timesteps for reference images.

- :mod:`~nw_adapter.correlate.cli`: argument parsing and the main job (``scripts/correlate.py``,
  ``nw-correlate``);
- :mod:`~nw_adapter.correlate.images`: reference-image loading and checks;
- :mod:`~nw_adapter.correlate.loading`: pipeline and IP-Adapter loading (Hub ids, local
  folders, the embedded tiny model);
- :mod:`~nw_adapter.correlate.report`: aggregation, table, JSON/CSV;
- :mod:`~nw_adapter.correlate.verdict`: the verdict, its clauses tested over reference images;
- :mod:`~nw_adapter.correlate.plotting`: figures (rho over the steps, the bandwidth path, maps over
  the image);
- :mod:`~nw_adapter.correlate.html_report`: ``report.html`` of every run and ``nw_adapter.report``
  (plotly, imported inside functions);
- :mod:`~nw_adapter.correlate.maps`: stored maps as arrays, per image token, averaged over
  layers, heads and steps;
- :mod:`~nw_adapter.correlate.previews`: the x0 estimate at a step, captured by a UNet hook;
- :mod:`~nw_adapter.correlate.outputs`: the output folder (checks, lock, files, ``--replot``);
- :mod:`~nw_adapter.correlate.sweep`: many images over several processes (accelerate), resume.
- :mod:`~nw_adapter.correlate.swap_cli`: ``--compare-swap``, stock against the exact NW head's generations.
- :mod:`~nw_adapter.correlate.swap_files`: its ``compare_swap.json`` / ``.csv`` and their reuse.

May import every layer below it (:mod:`nw_adapter.analysis`, :mod:`nw_adapter.integration`,
:mod:`nw_adapter.core`, :mod:`nw_adapter.models`, :mod:`nw_adapter.atomic`). The only layer that
prints or exits.
"""
