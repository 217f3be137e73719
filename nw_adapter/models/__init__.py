"""Embedded models: small diffusers pipelines and IP-Adapters in the public folder layouts.

- :mod:`~nw_adapter.models.tiny`: random-weight tiny SD 1.5 / SDXL pipelines and IP-Adapters,
  written once to local folders and loaded through ``from_pretrained`` / ``load_ip_adapter``
  exactly as the real models are (used by the tests and the benchmarks).
- :mod:`~nw_adapter.models.tiny_digits`: the *trained* tiny model shipped in ``weights/tiny_digits``
  (``--model tiny``), trained from scikit-learn's digits (:mod:`~nw_adapter.models.digits_data`)
  by :mod:`~nw_adapter.models.training`; :mod:`~nw_adapter.models.digits_quality` measures it.

May import: torch, diffusers, transformers, safetensors, scikit-learn, scipy and
:mod:`nw_adapter.atomic`; never the integration or the applications.
"""
