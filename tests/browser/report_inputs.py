"""Output folders of the four kinds of run, each written in a second or two: three from synthetic
data (no model), the support sets and a calibrated rho run by the command line on the trained tiny
model.

Each is what the command line leaves in ``--out`` (its ``rho.json`` / ``support.json`` /
``compare_swap.json``, the generated images, maps and x0 estimates), built with the command line's
own document builders, and its ``report.html`` written by the command line's own writers:

- :func:`rho_run`: two references, PNDM's repeated timestep, three blocks, the per-layer control
  (2 draws), stored maps at three steps (four image tokens, two grids);
- :func:`end_to_end_run`: the same records under the end-to-end control's meta, no maps;
- :func:`calibrated_run`: a rho run with ``--calibrate`` (the exact NW head measured in the same
  pipeline), run by the command line on the trained tiny model (three digits, four steps);
- :func:`support_run`: two support sets (m = 2 and m = 3), run by the command line on the trained
  tiny model (the support-set run reads the theory's posterior from a real generation);
- :func:`swap_run`: three references, two rules, with the comparison's images.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image

LAYERS = ("down_blocks.0.attentions.0.a", "mid_block.attentions.0.a", "up_blocks.1.attentions.0.a")
TIMESTEPS = (981.0, 961.0, 961.0, 941.0, 500.0, 1.0)  # PNDM: steps 1 and 2 share a timestep
MAP_STEPS = (0, 3, 5)
TOKENS = 4
SUPPORT_SETS = ((3, 7), (1, 4, 6))
"""The example digits of :func:`support_run`'s two sets."""


def digit(path: Path, value: int, size: int = 32) -> Path:
    """A 32 x 32 RGB picture (a bar whose place depends on ``value``) saved as PNG."""
    array = np.zeros((size, size, 3), dtype=np.uint8)
    array[4:28, 4 + 3 * value : 10 + 3 * value] = 230
    Image.fromarray(array).save(path)
    return path


def records(references: list[str], seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for r, reference in enumerate(references):
        level = 0.08 * r
        for step, timestep in enumerate(TIMESTEPS):
            h = 10.0 * 0.4**step
            for layer in LAYERS:
                for head in range(2):
                    for half in ("uncond", "cond"):
                        out.append(
                            {
                                "reference": reference,
                                "call": 0,
                                "step": step,
                                "timestep": timestep,
                                "alpha": 0.5,
                                "sigma": 0.5,
                                "h_schedule": h,
                                "layer": layer,
                                "block": layer.split("_")[0],
                                "head": head,
                                "half": half,
                                "adapter": 0,
                                "image": 0,
                                "scale": 1.0,
                                "num_keys": TOKENS,
                                "model": "tiny",
                                "mode": "observe",
                                "rho": 0.6 + level + 0.03 * step + rng.normal(0, 0.02),
                                "kl": 0.1,
                                "rho_perm_null": rng.normal(0, 0.05),
                                "rho_norm_matched_null": 0.5 + level,
                                "rho_spread_null": 0.55 + level,
                                "nw_gain": 0.01 + 0.001 * step,
                                "logit_scale": 0.5 / h**2 * math.exp(rng.normal(0, 0.1)),
                                "rho_control_0": 0.7,
                                "rho_control_1": 0.72,
                                "nw_gain_control_0": 0.0,
                                "nw_gain_control_1": 0.001,
                                "key_scale_0": 1.1,
                                "key_scale_1": 1.2,
                                "logit_scale_control_0": 2.0 * math.exp(rng.normal(0, 0.1)),
                                "logit_scale_control_1": 2.1 * math.exp(rng.normal(0, 0.1)),
                            }
                        )
    return out


def _maps(seed: int) -> dict[str, np.ndarray]:
    """Maps of every layer at :data:`MAP_STEPS`: ``[2 rows (uncond, cond), 1 head, query positions, tokens]``,
    rows summing to one over the tokens; the attention moves with the step (so the slider shows it)."""
    rng = np.random.default_rng(seed)
    maps = {}
    for step in MAP_STEPS:
        for layer in LAYERS:
            side = 2 if layer.startswith("mid") else 4
            for kind in ("attn", "nw"):
                logits = rng.normal(0, 1, (2, 1, side * side, TOKENS)).astype(np.float32)
                logits[..., step % TOKENS] += 2.0 * (1 + step)
                weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
                maps[f"call0/step{step}/{layer}/adapter0/image0/{kind}"] = weights.astype(np.float32)
    return maps


def rho_run(out: Path, *, maps: bool = True, control: str = "per-layer") -> dict:
    """A rho run's ``--out`` and its ``report.html``; returns the ``rho.json`` document."""
    from safetensors.numpy import save_file

    from nw_adapter.correlate.html_report import write_rho_report
    from nw_adapter.correlate.images import collect_image_paths, validate_images
    from nw_adapter.correlate.report import build_report, control_meta, write_report_files

    refs = out.parent / f"{out.name}-references"
    refs.mkdir(parents=True, exist_ok=True)
    infos = validate_images(collect_image_paths([digit(refs / f"digit_{i}.png", i) for i in (3, 7)]))
    images = []
    for index, info in enumerate(infos):
        folder = out / "images" / info.key
        folder.mkdir(parents=True, exist_ok=True)
        digit(folder / "generated.png", index + 1)
        entry = {**info.to_dict(), "generated": f"images/{info.key}/generated.png"}
        if maps:
            save_file(_maps(index), str(folder / "maps.safetensors"))
            for step in MAP_STEPS:
                digit(folder / f"x0_step{step}.png", step)
            entry.update(
                maps=f"images/{info.key}/maps.safetensors", attention_maps=f"images/{info.key}/a.png"
            )
        images.append(entry)
    config = {
        "model": {"model": "tiny"},
        "steps": 5,
        "bandwidth": "matched",
        "mode": "observe",
        "scheduler_class": "PNDMScheduler",
        "prompt": "a photograph",
        "seed": 0,
        "store_maps": maps,
    }
    document = build_report(
        records([info.key for info in infos]),
        config=config,
        images=images,
        targets=(),
        control=control_meta(draws=2, seed=0, kind=control),
    )
    write_report_files(document, out)
    write_rho_report(document, out)
    return document


def end_to_end_run(out: Path) -> dict:
    """A rho run of the end-to-end control (its ``control`` meta, no maps)."""
    return rho_run(out, maps=False, control="end-to-end")


CALIBRATED_DIGITS = (1, 3, 7)
"""The example digits of :func:`calibrated_run`."""


def calibrated_run(out: Path) -> dict:
    """A calibrated rho run's ``--out`` and its ``report.html``, written by the command line itself on
    the trained tiny model (three example digits, 4 steps, the exact head's second generation per
    digit: about 2 s); returns ``rho.json``."""
    import contextlib
    import io
    import json

    from nw_adapter.correlate.cli import main
    from nw_adapter.models.tiny_digits import example_image_path

    argv = ["--model", "tiny", "--steps", "4", "--calibrate", "-qq", "--out", str(out)]
    for value in CALIBRATED_DIGITS:
        argv += ["--image", str(example_image_path(value))]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    return json.loads((out / "rho.json").read_text(encoding="utf-8"))


def support_run(out: Path) -> dict:
    """A support-set run's ``--out`` and its ``report.html``, written by the command line itself on the
    trained tiny model (two sets, m = 2 and m = 3, of its example digits, 4 steps: about a second);
    returns ``support.json``."""
    import contextlib
    import io
    import json

    from nw_adapter.correlate.cli import main
    from nw_adapter.models.tiny_digits import example_image_path

    sets = [",".join(str(example_image_path(d)) for d in members) for members in SUPPORT_SETS]
    argv = ["--model", "tiny", "--steps", "4", "-qq", "--out", str(out)]
    for files in sets:
        argv += ["--support-set", files]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    return json.loads((out / "support.json").read_text(encoding="utf-8"))


def swap_run(out: Path) -> tuple[dict, object]:
    """A ``--compare-swap`` run's ``--out`` (three references, two rules) and its ``report.html``
    with the images; returns ``(compare_swap.json, the comparison)``."""
    from nw_adapter.analysis.consequence import SwapComparison
    from nw_adapter.correlate.html_report import write_swap_report
    from nw_adapter.correlate.images import collect_image_paths, validate_images
    from nw_adapter.correlate.report import write_json
    from nw_adapter.correlate.swap_files import build_document

    refs = out.parent / f"{out.name}-references"
    refs.mkdir(parents=True, exist_ok=True)
    infos = validate_images(collect_image_paths([digit(refs / f"digit_{i}.png", i) for i in (2, 5, 8)]))
    rng = np.random.default_rng(1)
    rules = ("matched", "schedule")
    rows, stock, seeds, swaps = [], [], [], {rule: [] for rule in rules}
    for index in range(len(infos)):
        base = rng.uniform(0, 1, (32, 32, 3)).astype(np.float32)
        other = np.clip(base + rng.normal(0, 0.3, base.shape), 0, 1).astype(np.float32)
        stock.append(base)
        seeds.append(other)
        for r, rule in enumerate(rules):
            swap = np.clip(base + rng.normal(0, 0.05 + 0.2 * r, base.shape), 0, 1).astype(np.float32)
            swaps[rule].append(swap)
            rows.append(
                {
                    "reference": index,
                    "rule": rule,
                    "abs_diff": float(np.abs(swap - base).mean()),
                    "abs_diff_other_seed": float(np.abs(other - base).mean()),
                    "clip_i_stock": 0.8,
                    "clip_i_swap": 0.78 - 0.1 * r + 0.01 * index,
                    "clip_i_change": -0.02 - 0.1 * r + 0.01 * index,
                }
            )
    comparison = SwapComparison(
        rules=rules,
        per_reference=rows,
        embedding="image_embeds",
        settings={"prompt": "a photograph"},
        stock_images=stock,
        swap_images=swaps,
        seed_images=seeds,
    )
    config = {
        "model": {"model": "tiny"},
        "steps": 4,
        "seed": 0,
        "guidance_scale": 7.5,
        "labels": None,
        "scheduler_class": "PNDMScheduler",
    }
    document = build_document(comparison, config=config, infos=infos, labels=None, fingerprint="f" * 64)
    write_json(out / "compare_swap.json", document)
    write_swap_report(out, document, comparison)
    return document, comparison
