"""Embedded models: small diffusers pipelines and IP-Adapters in the public folder layouts.

- :mod:`~nw_adapter.models.tiny`: random-weight tiny SD 1.5 / SDXL pipelines and IP-Adapters,
  written once to local folders and loaded through ``from_pretrained`` / ``load_ip_adapter``
  exactly as the real models are (used by the tests, the benchmarks and ``--model tiny``).

May import: torch, diffusers, transformers, safetensors and :mod:`nw_adapter.atomic`; never the
integration or the applications.
"""
