"""Measure the trained tiny Flux digits model and regenerate its model card's measured sections.

    $ python scripts/evaluate_tiny_flow.py quality     # class agreement per support size m = 1, 2, 4
    $ python scripts/evaluate_tiny_flow.py losses      # held-out flow loss: right / black / wrong reference
    $ python scripts/evaluate_tiny_flow.py training --run-dir runs/tiny_flux   # stage table, files
    $ python scripts/evaluate_tiny_flow.py pilot --model-dir runs/x/tiny_flux_digits  # recipe choice

``pilot`` measures m = 1 on 100 digits of the ``judge`` split (10 per class,
:func:`~nw_adapter.models.support_quality.pilot_references`), seeds ``1000 + k``, the quality's
settings otherwise: recipes are chosen on it without touching the ``reference`` digits.

``quality`` generates one image per disjoint held-out support set (m references of one class,
one adapter's list of images), at IP scale 1 and 0, and the judge of
:mod:`nw_adapter.models.digits_quality` labels it; it writes ``quality.json`` under ``--out``
and, with ``--card``, rewrites the card's section between ``<!-- quality:begin -->`` and
``<!-- quality:end -->`` (atomically).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nw_adapter.commands import ScriptParser, output_folder, whole_number

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_tiny import (  # noqa: E402  (the SD 1.5 model's card writers and judge)
    STAGE_TABLE_HEADER,
    file_table,
    fitted_judge,
    model_folder_ready,
    replace_section,
    total_line,
    write_training_sections,
)

SUPPORT_SIZES = (1, 2, 4)
IP_SCALES = (1.0, 0.0)
STEPS = 25
TRUE_CFG_SCALE = 5.0  # nw_adapter.models.tiny_flux_digits.QUALITY_TRUE_CFG_SCALE
"""True classifier-free guidance of the measurement (negative prompt ``""``, negative image black),
as the SD 1.5 model is measured at guidance 7.5. Chosen from a pilot on 20 of the references
(m = 1, IP scale 1: 4/20 agreed at 1 (no guidance), 14/20 at 3, 17/20 at 5, 13/20 at 7.5), so
the measurement at 5 is not independent of that choice (the model card says so)."""


PILOT_SEED = 1000


def _call_kwargs(true_cfg_scale: float) -> dict:
    """The pipeline call of every measurement: the model's size and T5 length, and above 1 true CFG
    with the negative prompt ``""`` (the negative image is the pipeline's black one)."""
    from nw_adapter.models.loaders import TINY_FLUX_DIGITS_CALL

    call = dict(TINY_FLUX_DIGITS_CALL)
    if true_cfg_scale > 1:
        call.update(true_cfg_scale=true_cfg_scale, negative_prompt="")
    return call


def _timed(measure: Callable[[], Any]) -> tuple[Any, dict]:
    """``measure()``'s result and its JSON row (the result's fields and the wall seconds it took)."""
    started = time.perf_counter()
    result = measure()
    return result, {**result.to_dict(), "seconds": round(time.perf_counter() - started, 1)}


def pilot(model_dir: Path, out: Path, *, true_cfg_scale: float, ip_scales: tuple[float, ...]) -> list[str]:
    """m = 1 agreement on the judge-split pilot references, per IP scale; writes ``pilot.json``."""
    import torch

    from nw_adapter.atomic import atomic_write_json
    from nw_adapter.models.digits_data import load_digit_splits
    from nw_adapter.models.support_quality import measure_support_agreement, pilot_references
    from nw_adapter.models.tiny_flux_digits import load_pipeline

    torch.set_num_threads(1)
    judge, _, _ = fitted_judge()
    references = pilot_references(load_digit_splits()["judge"])
    pipe = load_pipeline(model_dir)
    call = _call_kwargs(true_cfg_scale)
    rows, results = [], []
    for ip_scale in ip_scales:
        result, row = _timed(
            lambda ip_scale=ip_scale: measure_support_agreement(
                pipe, judge, references, 1, ip_scale=ip_scale, steps=STEPS, seed=PILOT_SEED, call_kwargs=call
            )
        )
        results.append(row)
        rows.append(
            f"pilot m=1 IP scale {ip_scale:g}: {result.agreed}/{result.n} "
            f"[{result.ci_low:.0%}, {result.ci_high:.0%}] ({results[-1]['seconds']} s)"
        )
        print(rows[-1], file=sys.stderr)
    atomic_write_json(
        out / "pilot.json",
        {"model_dir": str(model_dir), "true_cfg_scale": true_cfg_scale, "results": results},
    )
    return rows


def quality(model_dir: Path, out: Path, *, true_cfg_scale: float, limit: int | None) -> str:
    """Class agreement for every support size and IP scale; returns the markdown section."""
    import torch

    from nw_adapter.atomic import atomic_write_json
    from nw_adapter.models.support_quality import measure_support_agreement
    from nw_adapter.models.tiny_flux_digits import load_pipeline

    torch.set_num_threads(1)
    judge, references, judge_on_references = fitted_judge()
    pipe = load_pipeline(model_dir)
    call = _call_kwargs(true_cfg_scale)
    rows, results = [], []
    for size in SUPPORT_SIZES:
        for ip_scale in IP_SCALES:
            result, row = _timed(
                lambda size=size, ip_scale=ip_scale: measure_support_agreement(
                    pipe,
                    judge,
                    references,
                    size,
                    ip_scale=ip_scale,
                    steps=STEPS,
                    call_kwargs=call,
                    limit=limit,
                )
            )
            results.append(row)
            rows.append(
                f"| {size} | {ip_scale:g} | {result.agreed}/{result.n} = {result.agreement:.0%} "
                f"| [{result.ci_low:.0%}, {result.ci_high:.0%}] | {result.p_above_chance:.1e} |"
            )
            print(rows[-1], file=sys.stderr)
    atomic_write_json(
        out / "quality.json",
        {
            "judge_accuracy_on_references": judge_on_references,
            "true_cfg_scale": true_cfg_scale,
            "results": results,
        },
    )
    guidance = (
        "no classifier-free guidance (`true_cfg_scale=1`, FluxPipeline's default)"
        if true_cfg_scale <= 1
        else f'true CFG `true_cfg_scale={true_cfg_scale:g}`, negative prompt `""` (negative image: black)'
    )
    return "\n".join(
        [
            "Judge (RBF SVM on 8 x 8 features, fitted on the 400 `judge` digits): "
            f"{judge_on_references:.0%} correct on the 100 real reference digits. Prompt "
            f'`"a photograph"`, {guidance}, {STEPS} Euler steps, 32 x 32, `max_sequence_length=32`, '
            "seed `k` for support set `k`. "
            "Support sets: the 100 held-out references cut into disjoint sets of one class "
            "(`nw_adapter.models.support_quality.support_sets`), one generation each, so the sets are "
            "independent units. Chance: 10%.",
            "",
            "| support size m | IP scale | agreement | 95% CI (Clopper-Pearson) "
            "| p vs chance (one-sided binomial) |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )


def stage_rows(config: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Per stage of the training record ``config``: (stage, what is trained, data and objective,
    "steps x batch, lr"), the text following the settings (the caption drop of stage 1, the
    transformer trained with the adapter in stage 2)."""
    drop = (
        '15% dropped, each to "", "a photograph" or "a handwritten digit"'
        if config.get("transformer_class_free_drop")
        else "15% empty prompt"
    )
    joint = float(config.get("adapter_transformer_lr") or 0.0)
    batch = config["batch_size"]
    adapter_lr = f"{config['adapter_lr']:g}" + (f" (transformer {joint:g})" if joint else "")
    return [
        (
            "transformer",
            "transformer (stage 1)",
            "train latents; rectified-flow MSE to eps - z0, s ~ logit-normal; "
            f"captions (pooled CLIP + T5), {drop}",
            f"{config['transformer_steps']} x {batch}, {config['transformer_lr']:g}",
        ),
        (
            "adapter",
            "IP-Adapter and transformer (stage 2)" if joint else "IP-Adapter only (stage 2)",
            "support sets of m = 1..4 other train images of the target's class "
            "(m per step), class-free prompt, 5% black-image drop; same loss",
            f"{config['adapter_steps']} x {batch}, {adapter_lr}",
        ),
    ]


def training(run_dir: Path, model_dir: Path) -> tuple[str, str]:
    """The card's stage table (``run_dir/stages/log.json``) and file table (sizes, SHA-256)."""
    from nw_adapter.models.tiny_flux_digits import ADAPTER_SUBFOLDER, ADAPTER_WEIGHT_NAME

    log = json.loads((run_dir / "stages" / "log.json").read_text())
    config = log["config"]
    rows, stages = list(STAGE_TABLE_HEADER), stage_rows(config)
    for key, name, objective, steps in stages:
        entry = log[key]
        rows.append(
            f"| {key} | {name} | {objective} | {steps} "
            f"| {entry['seconds'] / 60:.1f} min | {entry['mean_last_50']:.4f} |"
        )
    rows.append(total_line(log, [key for key, *_ in stages]))
    return "\n".join(rows), file_table(model_dir, model_dir / ADAPTER_SUBFOLDER / ADAPTER_WEIGHT_NAME)


def _finite(option: str, minimum: float) -> Callable[[str], float]:
    """argparse ``type=`` of a finite number >= ``minimum``, with an error naming ``option``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= minimum):
            raise argparse.ArgumentTypeError(f"{option} must be a finite number >= {minimum:g}, got {text!r}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    from nw_adapter.models.tiny_flux_digits import SHIPPED_DIR

    parser = ScriptParser(prog="evaluate_tiny_flow.py", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("quality", "losses", "training", "pilot"))
    parser.add_argument(
        "--run-dir", type=Path, default=Path("runs/tiny_flux"), help="training: train_tiny_flow.py --out"
    )
    parser.add_argument("--model-dir", type=Path, default=SHIPPED_DIR, help="model folder (default: shipped)")
    parser.add_argument(
        "--out", type=output_folder("--out"), default=Path("runs/tiny_flux_eval"), help="output folder"
    )
    parser.add_argument(
        "--true-cfg-scale",
        type=_finite("--true-cfg-scale", 1.0),
        default=TRUE_CFG_SCALE,
        help="quality: Flux true CFG (>= 1)",
    )
    parser.add_argument(
        "--limit",
        type=whole_number("--limit", 1),
        default=None,
        help="quality: at most this many support sets per m",
    )
    parser.add_argument("--card", type=Path, default=None, help="model card whose sections to rewrite")
    parser.add_argument(
        "--ip-scales",
        type=_finite("--ip-scales", 0.0),
        nargs="+",
        default=[1.0],
        help="pilot: IP scales to measure, each >= 0 (default 1)",
    )
    args = parser.parse_args(argv)
    reads = {
        "--run-dir": {"training"},
        "--out": {"quality", "losses", "pilot"},
        "--true-cfg-scale": {"quality", "pilot"},
        "--limit": {"quality"},
        "--card": {"quality", "training"},
        "--ip-scales": {"pilot"},
    }
    parser.refuse_unread(argv, args.what, reads)
    sections = {"training": ("training", "files"), "quality": ("quality",)}.get(args.what, ())
    card = args.card if sections else None  # losses and pilot write no card section
    run_dir = args.run_dir if args.what == "training" else None
    if not model_folder_ready(
        "evaluate_tiny_flow.py", args.model_dir, args.out, card=card, sections=sections, run_dir=run_dir
    ):
        return 2
    if args.what == "training":
        write_training_sections(*training(args.run_dir, args.model_dir), args.card)
        return 0
    if args.what == "losses":
        import torch

        from nw_adapter.atomic import atomic_write_json
        from nw_adapter.models.digits_data import load_digit_splits
        from nw_adapter.models.tiny_flux_digits import held_out_flow_losses, load_pipeline

        torch.set_num_threads(1)
        splits = load_digit_splits()
        losses = held_out_flow_losses(load_pipeline(args.model_dir), splits["judge"], splits["reference"])
        atomic_write_json(args.out / "losses.json", losses)
        print(" ".join(f"{name} {value:.4f}" for name, value in losses.items()))
        return 0
    if args.what == "pilot":
        pilot(args.model_dir, args.out, true_cfg_scale=args.true_cfg_scale, ip_scales=tuple(args.ip_scales))
        return 0
    body = quality(args.model_dir, args.out, true_cfg_scale=args.true_cfg_scale, limit=args.limit)
    print(body)
    if args.card is not None:
        replace_section(args.card, "quality", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
