"""Command lines that reach each run of ``correlate.py`` with one option added (for the option walk).

:func:`context` is the smallest command line of a run (its selector and its inputs);
:func:`option_argv` one option with a value its parser accepts (not its default).
"""

from __future__ import annotations

from nw_adapter.correlate.option_rows import Option, Run

SAMPLES: dict[str, str] = {
    "image": "other.png",
    "image_dir": "refs",
    "model": "tiny-flux",
    "ip_adapter": "some/adapter",
    "subfolder": "models",
    "weight_name": "w.safetensors",
    "image_encoder": "some/encoder",
    "scheduler": "ddim",
    "device": "cpu",
    "dtype": "float32",
    "prompt": "a cat",
    "negative_prompt": "blurry",
    "steps": "3",
    "seed": "5",
    "guidance_scale": "3",
    "ip_scale": "0.5",
    "guidance_rescale": "0.7",
    "true_cfg_scale": "2",
    "height": "64",
    "width": "64",
    "mode": "swap",
    "bandwidth": "fitted",
    "layers": "up",
    "control_draws": "2",
    "untrained_seed": "7",
    "out": "elsewhere",
    "replot": "old",
    "swap_rules": "matched",
    "labels": "3",
    "support_set": "c.png,d.png",
    "support_dir": "sets",
    "end_to_end_draws": "2",
    "end_to_end_seed": "3",
    "calibrate_c": "2",
}
"""One accepted value per option that takes a value."""

CONTEXTS: dict[str, list[str]] = {
    "rho": ["--image", "ref.png"],
    "end-to-end": ["--end-to-end-control", "--image", "ref.png"],
    "compare-swap": ["--compare-swap", "--image", "ref.png"],
    "support-sets": ["--support-set", "a.png,b.png"],
    "replot": ["--replot", "done"],
}
"""The smallest command line of each run."""


def context(run: Run) -> list[str]:
    """The smallest command line that chooses ``run``."""
    return list(CONTEXTS[run.name])


def takes_value(option: Option) -> bool:
    """Whether the option is followed by a value."""
    return option.action not in ("store_true", "store_false", "count") and option.dest != "example_dir"


NEEDED: dict[str, list[str]] = {"calibrate_c": ["--calibrate"]}
"""Options read only beside another one (their :class:`~nw_adapter.correlate.option_rows.Needs`
not met by the defaults): that one, given first."""


def option_argv(option: Option) -> list[str]:
    """The option with a value its parser accepts, other than its default (after the option it needs)."""
    own = [option.name, SAMPLES[option.dest]] if takes_value(option) else [option.name]
    return [*NEEDED.get(option.dest, []), *own]
