"""Measure the trained tiny digits model and regenerate the model card's measured sections.

    $ python scripts/evaluate_tiny.py quality   # class agreement on the 100 held-out references
    $ python scripts/evaluate_tiny.py captions  # does stage 1 read the caption? (loss gap, generations)
    $ python scripts/evaluate_tiny.py rho       # rho across timesteps with its nulls (correlate CLI)
    $ python scripts/evaluate_tiny.py conflict  # a caption naming another digit vs the reference
    $ python scripts/evaluate_tiny.py training --run-dir runs/tiny   # stage table, file sizes, hashes

Each command measures the model folder (default: the shipped one), writes its JSON and the
printed table under ``--out``, and, with ``--card``, rewrites the section between the card's
``<!-- NAME:begin -->`` / ``<!-- NAME:end -->`` markers (atomically).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from nw_adapter.commands import ScriptParser, output_folder, whole_number

QUALITY_SETTINGS = (
    # (ip_scale, guidance_scale, steps): the CLI's default guidance at the quickstart's 25 steps,
    # and the IP-scale-0 control.
    (1.0, 7.5, 25),
    (0.0, 7.5, 25),
)


def _load(model_dir: Path):
    import torch
    from diffusers import StableDiffusionPipeline

    from nw_adapter.models.tiny_digits import ADAPTER_SUBFOLDER, ADAPTER_WEIGHT_NAME

    pipe = StableDiffusionPipeline.from_pretrained(model_dir, torch_dtype=torch.float32)
    pipe.load_ip_adapter(model_dir, subfolder=ADAPTER_SUBFOLDER, weight_name=ADAPTER_WEIGHT_NAME)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def fitted_judge():
    """The judge fitted on the ``judge`` split, the held-out ``reference`` split, and the judge's
    accuracy on the references' real images (the ceiling of any agreement)."""
    from nw_adapter.models.digits_data import digit_features, load_digit_splits
    from nw_adapter.models.digits_quality import fit_judge

    splits = load_digit_splits()
    judge = fit_judge(splits["judge"])
    references = splits["reference"]
    judge_on_references = float(
        (judge.predict(digit_features(references.images)) == references.labels).mean()
    )
    return judge, references, judge_on_references


def quality(model_dir: Path, out: Path) -> str:
    """Class agreement at every :data:`QUALITY_SETTINGS` entry; returns the markdown section."""
    import torch

    from nw_adapter.atomic import atomic_write_json
    from nw_adapter.models.digits_quality import measure_agreement

    torch.set_num_threads(1)
    judge, references, judge_on_references = fitted_judge()
    pipe = _load(model_dir)
    rows, results = [], []
    for ip_scale, guidance, steps in QUALITY_SETTINGS:
        started = time.perf_counter()
        result = measure_agreement(
            pipe, judge, references, ip_scale=ip_scale, guidance_scale=guidance, steps=steps
        )
        seconds = time.perf_counter() - started
        results.append({**result.to_dict(), "seconds": round(seconds, 1)})
        rows.append(
            f"| {ip_scale:g} | {guidance:g} | {steps} "
            f"| {result.agreed}/{result.n} = {result.agreement:.0%} | "
            f"[{result.ci_low:.0%}, {result.ci_high:.0%}] | {result.p_above_chance:.1e} |"
        )
        print(rows[-1], file=sys.stderr)
    atomic_write_json(
        out / "quality.json", {"judge_accuracy_on_references": judge_on_references, "results": results}
    )
    return "\n".join(
        [
            f"Judge (RBF SVM on 8 x 8 features, fitted on the 400 `judge` digits): {judge_on_references:.0%} "
            'correct on the 100 real reference digits. Prompt `"a photograph"`, PNDM, seed `i` for '
            "reference `i`, one reference per call. Chance: 10%.",
            "",
            "| IP scale | guidance | steps | agreement | 95% CI (Clopper-Pearson) "
            "| p vs chance (one-sided binomial) |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )


def captions(model_dir: Path, out: Path) -> str:
    """Stage 1's use of the text: paired held-out losses, and caption-only generations (IP scale 0)."""
    import torch
    from diffusers import StableDiffusionPipeline

    from nw_adapter.atomic import atomic_write_json
    from nw_adapter.models.digits_data import class_captions, load_digit_splits
    from nw_adapter.models.digits_quality import caption_epsilon_losses, fit_judge, measure_agreement

    torch.set_num_threads(1)
    splits = load_digit_splits()
    plain = StableDiffusionPipeline.from_pretrained(model_dir, torch_dtype=torch.float32)
    losses = caption_epsilon_losses(plain, splits["judge"], seed=0)
    references = splits["reference"]
    prompts = [class_captions(int(label))[i % 3] for i, label in enumerate(references.labels)]
    result = measure_agreement(
        _load(model_dir), fit_judge(splits["judge"]), references, ip_scale=0.0, prompt=prompts
    )
    atomic_write_json(out / "captions.json", {"losses": losses, "generations": result.to_dict()})
    return "\n".join(
        [
            "Held-out epsilon loss of the UNet on the 400 `judge` digits (one seeded noise and timestep "
            "per image, the same for the three prompts):",
            "",
            "| caption | right digit | wrong digit (y + 1) | empty prompt |",
            "|---|---|---|---|",
            f"| loss | {losses['right']:.5f} | {losses['wrong']:.5f} | {losses['empty']:.5f} |",
            "",
            "Generations from the caption alone (IP scale 0, guidance 7.5, 25 steps; reference `i`'s "
            "class in wording `i mod 3`, 100 references): the judge labels "
            f"{result.agreed}/{result.n} = {result.agreement:.0%} with the caption's digit "
            f"(95% CI [{result.ci_low:.0%}, {result.ci_high:.0%}]; chance 10%).",
        ]
    )


CONFLICT_REFERENCES_PER_CLASS = 3


def conflict(model_dir: Path, out: Path) -> str:
    """Reference image against a caption naming another digit: which class does the generation take?

    The first :data:`CONFLICT_REFERENCES_PER_CLASS` references of every class (30 in all), each
    with the caption of digit ``(y + 1) mod 10`` in wording ``i mod 3``, IP scale 1, guidance 7.5,
    25 steps, seed ``i`` for reference ``i``; the judge labels each generation.
    """
    import numpy as np
    import torch
    from scipy.stats import binomtest

    from nw_adapter.atomic import atomic_write_json
    from nw_adapter.models.digits_data import DigitSplit, class_captions, load_digit_splits
    from nw_adapter.models.digits_quality import fit_judge, measure_agreement

    torch.set_num_threads(1)
    splits = load_digit_splits()
    references = splits["reference"]
    rows = np.concatenate(
        [np.flatnonzero(references.labels == d)[:CONFLICT_REFERENCES_PER_CLASS] for d in range(10)]
    )
    subset = DigitSplit(references.images[rows], references.labels[rows], references.indices[rows])
    captioned = (subset.labels + 1) % 10
    prompts = [class_captions(int(d))[i % 3] for i, d in enumerate(captioned)]
    result = measure_agreement(
        _load(model_dir), fit_judge(splits["judge"]), subset, ip_scale=1.0, prompt=prompts
    )
    predicted = np.asarray(result.predicted)
    n = len(subset)
    keeps_reference = int((predicted == subset.labels).sum())
    follows_caption = int((predicted == captioned).sum())
    ci_ref = binomtest(keeps_reference, n).proportion_ci(confidence_level=0.95, method="exact")
    ci_cap = binomtest(follows_caption, n).proportion_ci(confidence_level=0.95, method="exact")
    atomic_write_json(
        out / "conflict.json",
        {
            "generations": result.to_dict(),
            "reference_labels": subset.labels.tolist(),
            "caption_labels": captioned.tolist(),
            "keeps_reference": keeps_reference,
            "follows_caption": follows_caption,
        },
    )
    return (
        f"{n} held-out references ({CONFLICT_REFERENCES_PER_CLASS} per class), each with the caption of "
        "digit (y + 1) mod 10 (wording i mod 3), IP scale 1, guidance 7.5, 25 steps, seed i: the judge "
        f"labels {keeps_reference}/{n} with the reference's class (95% CI [{ci_ref.low:.0%}, "
        f"{ci_ref.high:.0%}]) and {follows_caption}/{n} with the caption's digit "
        f"([{ci_cap.low:.0%}, {ci_cap.high:.0%}]); {n - keeps_reference - follows_caption} with neither."
    )


def rho(model_dir: Path, out: Path, steps: int) -> str:
    """Run the correlate CLI on the ten bundled examples; returns its table as a markdown section."""
    from nw_adapter.correlate.cli import main
    from nw_adapter.correlate.report import format_report

    examples = sorted((model_dir / "examples").glob("digit_*.png"))
    argv = [arg for image in examples for arg in ("--image", str(image))]
    argv += ["--model", str(model_dir), "--ip-adapter", str(model_dir), "--steps", str(steps)]
    argv += ["--device", "cpu", "--quiet", "--out", str(out / "rho")]
    code = main(argv)
    if code != 0:
        raise SystemExit(code)
    report = json.loads((out / "rho" / "rho.json").read_text())
    command = "python scripts/correlate.py " + " ".join(argv).replace(str(model_dir), "<model>")
    return "\n".join(
        ["Command (`<model>` = this folder):", "", f"    {command}", "", "```", format_report(report), "```"]
    )


STAGES = (
    ("vae", "VAE (stage 0)", "train images; MSE(x, D(z)) + 1e-4 KL, z ~ q(z|x)", "vae_steps", 2e-3, 1),
    (
        "image_encoder",
        "image encoder + linear head",
        "train images, +-2 px shifts; cross-entropy on `image_embeds`",
        "encoder_steps",
        2e-3,
        2,
    ),
    (
        "text_encoder",
        "text encoder + linear head",
        "30 captions + 3 class-free prompts; cross-entropy of digit / no digit at every position "
        "from end-of-text on",
        "text_encoder_steps",
        3e-3,
        0,
    ),
    (
        "unet",
        "UNet (stage 1)",
        "train latents; epsilon MSE, conditioned on the frozen text encoder's caption states, "
        "15% empty prompt",
        "unet_steps",
        1e-3,
        1,
    ),
    (
        "adapter",
        "IP-Adapter only (stage 2)",
        "(reference, target) pairs of one class; epsilon MSE, class-free prompt",
        "adapter_steps",
        5e-3,
        1,
    ),
)


def _prompt_count() -> int:
    """Prompts of the text-encoder stage (one full batch): every caption and class-free prompt."""
    from nw_adapter.models.digits_data import class_captions
    from nw_adapter.models.training.run import STAGE2_PROMPTS

    return sum(len(class_captions(digit)) for digit in range(10)) + len(STAGE2_PROMPTS)


def training(run_dir: Path, model_dir: Path) -> tuple[str, str]:
    """The card's stage table (from ``run_dir/stages/log.json``) and its file table (sizes, SHA-256)."""
    log = json.loads((run_dir / "stages" / "log.json").read_text())
    config = log["config"]
    rows = list(STAGE_TABLE_HEADER)
    for key, name, objective, steps_key, lr, batch_factor in STAGES:
        entry = log[key]
        extra = (
            f"; held-out accuracy {entry['held_out_accuracy']:.1%}" if "held_out_accuracy" in entry else ""
        )
        if "caption_accuracy" in entry:
            extra = f"; accuracy {entry['caption_accuracy']:.0%} (training prompts)"
        lr = config.get(f"{key}_lr", lr)  # a stage whose learning rate is a config field
        batch = f"{batch_factor * config['batch_size']}" if batch_factor else f"{_prompt_count()} (full)"
        rows.append(
            f"| {key} | {name} | {objective} "
            f"| {config[steps_key]} x {batch}, {lr:g} "
            f"| {entry['seconds'] / 60:.1f} min | {entry['mean_last_50']:.4f}{extra} |"
        )
    rows.append(total_line(log, [key for key, *_ in STAGES]))
    return "\n".join(rows), file_table(model_dir, model_dir / "models" / "ip-adapter_sd15.safetensors")


STAGE_TABLE_HEADER = [
    "| stage | trained | data and objective | steps x batch, lr | time | loss (mean of last 50 steps) |",
    "|---|---|---|---|---|---|",
]


def total_line(log: dict, stage_keys: list[str]) -> str:
    """The line under the stage table: the stages' total time, torch version, threads and seed."""
    config = log["config"]
    total = sum(log[key]["seconds"] for key in stage_keys)
    return (
        f"\nTotal: {total / 60:.1f} min ({log['torch']}, {config['threads']} thread(s), "
        f"seed {config['seed']})."
    )


def file_table(model_dir: Path, adapter_file: Path) -> str:
    """The card's file section: total size, the adapter's parameter count, every weight's SHA-256."""
    import hashlib

    from safetensors.torch import load_file

    files = sorted(path for path in model_dir.rglob("*") if path.is_file() and path.name != "MODEL_CARD.md")
    size = sum(path.stat().st_size for path in files)
    adapter = load_file(adapter_file)
    table = [
        f"All files: {size / 2**20:.2f} MiB; "
        f"adapter: {sum(v.numel() for v in adapter.values()):,} parameters.",
        "",
        "| file | bytes | SHA-256 |",
        "|---|---|---|",
    ]
    for path in files:
        if path.suffix == ".safetensors":
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            table.append(
                f"| `{path.relative_to(model_dir)}` | {path.stat().st_size:,} | `{digest[:16]}...` |"
            )
    return "\n".join(table)


def replace_section(card: Path, name: str, body: str) -> None:
    """Replace the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` in ``card``."""
    from nw_adapter.atomic import atomic_write_text

    text = card.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"evaluate_tiny.py: error: {card} has no {begin} ... {end} markers; add them")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    atomic_write_text(card, f"{head}{begin}\n{body}\n{end}{tail}")


def model_folder_ready(
    script: str,
    model_dir: Path,
    out: Path,
    *,
    card: Path | None = None,
    sections: tuple[str, ...] = (),
    run_dir: Path | None = None,
) -> bool:
    """Whether the inputs can be used (else print the one-line error and return False), checked
    before anything is computed: ``model_dir`` a model folder whose weight files safetensors can open,
    ``card`` (when given) a file with the ``sections``' markers, ``run_dir`` (when given) a training
    run with its ``stages/log.json``. Creates ``out``."""
    problem = None
    if not (model_dir / "model_index.json").is_file():
        problem = f"'{model_dir}' has no model_index.json; pass --model-dir"
    elif (damaged := damaged_weights(model_dir)) is not None:
        problem = f"--model-dir '{model_dir}': {damaged}; copy the model again or pass another --model-dir"
    elif card is not None:
        problem = card_problem(card, sections)
    if problem is None and run_dir is not None and not (run_dir / "stages" / "log.json").is_file():
        problem = f"--run-dir '{run_dir}' has no stages/log.json; pass the --out folder of a training run"
    if problem is not None:
        print(f"{script}: error: {problem}", file=sys.stderr)
        return False
    out.mkdir(parents=True, exist_ok=True)
    return True


def damaged_weights(model_dir: Path) -> str | None:
    """The first ``.safetensors`` file of ``model_dir`` that safetensors cannot open (empty, truncated,
    another format), named with its size; None when every one opens (headers only are read)."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(model_dir.rglob("*.safetensors")):
        try:
            with safe_open(str(path), framework="numpy") as weights:
                weights.keys()
        except (SafetensorError, OSError, ValueError):
            size = path.stat().st_size
            what = "is empty" if size == 0 else f"is not a complete safetensors file ({size} bytes)"
            return f"{path.relative_to(model_dir)} {what}"
    return None


def card_problem(card: Path, sections: tuple[str, ...]) -> str | None:
    """Why ``--card`` cannot take the ``sections`` (None: it can): not a readable text file, or a
    section without its ``<!-- name:begin -->`` ... ``<!-- name:end -->`` markers."""
    try:
        text = card.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return (
            f"--card '{card}' cannot be read ({getattr(exc, 'strerror', None) or exc}); pass the model card"
        )
    for name in sections:
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        if begin not in text or end not in text:
            return f"--card '{card}' has no {begin} ... {end} markers; add them"
    return None


def write_training_sections(stages: str, files: str, card: Path | None) -> None:
    """Print the stage and file tables and, with a card, rewrite its ``training`` and ``files`` sections."""
    print(stages + "\n\n" + files)
    if card is not None:
        replace_section(card, "training", stages)
        replace_section(card, "files", files)


def main(argv: list[str] | None = None) -> int:
    from nw_adapter.models.tiny_digits import SHIPPED_DIR

    parser = ScriptParser(prog="evaluate_tiny.py", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("quality", "captions", "rho", "conflict", "training"))
    parser.add_argument(
        "--run-dir", type=Path, default=Path("runs/tiny"), help="training: train_tiny.py --out"
    )
    parser.add_argument("--model-dir", type=Path, default=SHIPPED_DIR, help="model folder (default: shipped)")
    parser.add_argument(
        "--out", type=output_folder("--out"), default=Path("runs/tiny_eval"), help="output folder"
    )
    parser.add_argument(
        "--steps", type=whole_number("--steps", 1), default=25, help="rho: denoising steps (default 25)"
    )
    parser.add_argument("--card", type=Path, default=None, help="model card whose section to rewrite")
    args = parser.parse_args(argv)
    evaluations = {"quality", "captions", "rho", "conflict"}
    parser.refuse_unread(
        argv, args.what, {"--run-dir": {"training"}, "--steps": {"rho"}, "--out": evaluations}
    )
    sections = ("training", "files") if args.what == "training" else (args.what,)
    run_dir = args.run_dir if args.what == "training" else None
    if not model_folder_ready(
        "evaluate_tiny.py", args.model_dir, args.out, card=args.card, sections=sections, run_dir=run_dir
    ):
        return 2
    if args.what == "training":
        write_training_sections(*training(args.run_dir, args.model_dir), args.card)
        return 0
    if args.what == "quality":
        body = quality(args.model_dir, args.out)
    elif args.what == "captions":
        body = captions(args.model_dir, args.out)
    elif args.what == "conflict":
        body = conflict(args.model_dir, args.out)
    else:
        body = rho(args.model_dir, args.out, args.steps)
    print(body)
    if args.card is not None:
        replace_section(args.card, args.what, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
