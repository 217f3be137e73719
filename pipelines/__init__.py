"""Companion diffusers pipelines: stock pipelines plus
:class:`nw_adapter.integration.mixin.NWIPAdapterMixin`."""
