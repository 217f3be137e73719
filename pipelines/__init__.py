"""Companion diffusers pipelines: stock pipelines plus :class:`nw_adapter.mixin.NWIPAdapterMixin`."""
