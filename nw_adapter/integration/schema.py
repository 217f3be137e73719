"""Names of the recorded fields, shared by the recorder and the reports (no torch import).

One record is one (call, step, layer, head, CFG half, adapter, image): the identifying keys of
:data:`RECORD_KEYS` followed by the statistics of :data:`STAT_NAMES`.
"""

from __future__ import annotations

#: Keys that identify a record and its noise level, in column order.
RECORD_KEYS: tuple[str, ...] = (
    "call",
    "step",
    "timestep",
    "alpha",
    "sigma",
    "h_schedule",
    "layer",
    "block",
    "head",
    "half",
    "adapter",
    "image",
    "scale",
    "num_keys",
    "key_set",
)

#: Key sets a softmax is compared over: "ip" (the IP-Adapter keys; UNet and Flux image branches
#: are a softmax over these alone, and SD3's joint softmax restricted to them and renormalised)
#: and "joint" (SD3: the image's own keys and the IP keys of its one image-branch softmax).
KEY_SETS: tuple[str, ...] = ("ip", "joint")

#: Statistics recorded by some families only (SD3: the joint softmax's mass on the IP keys).
OPTIONAL_STATS: tuple[str, ...] = ("ip_mass",)

#: Statistics of one (layer, head, half, adapter, image), in the order of the processor's stats tensor.
STAT_NAMES: tuple[str, ...] = (
    "bandwidth",
    "rho",
    "rho_perm_null",
    "rho_norm_null",
    "pearson",
    "kl",
    "js",
    "neff_attn",
    "neff_nw",
    "top1",
    "q_norm",
    "key_norm_cv",
)

#: The statistics in reporting order (rho first, the bandwidth used last).
SUMMARY_STATS: tuple[str, ...] = tuple(s for s in STAT_NAMES if s != "bandwidth") + ("bandwidth",)

#: Top-level export field of the (call, step, layer) pairs whose side computation failed in
#: observe mode (the layer returned the stock output): ``{"count", "by_reason", "pairs"}``.
SKIPPED_FIELD = "skipped"
