"""nw-adapter: IP-Adapter cross-attention as Nadaraya-Watson kernel smoothing.

The pure math (``kernels``, ``bandwidth``, ``paths``, ``sampling``, ``metrics``) imports
torch only. The diffusers integration lives in ``processor``, ``recorder``, ``mixin`` and
``config`` and is imported on first use, so ``import nw_adapter`` stays light.
"""

__version__ = "0.1.0"
