"""The theory's model in the pipeline: exact field, known answer, learned x0 vs plug-in, outcomes over m.

Writes into --out (atomically; nothing outside it):

- ``exact_field.json``: max abs / relative error of the NWFieldPipeline stand-ins against
  nw_adapter.core's exact field on random latents (tiny SD 1.5 digits, tiny Flux digits, random
  tiny SDXL through Euler's own x0, random tiny SD 3);
- ``known_answer.json``: tiny SD 1.5 digits 3 and 7, the plug-in field under PNDM (30 steps) per
  seed: the distance of the generated latent to each reference, the reference it lands on, the
  posterior per step; the same field under DDIM with and without ``clip_sample``;
- ``outcomes.json`` / ``outcomes.csv`` / ``outcomes.txt``: over support sets of m held-out digits
  (same class and mixed; the unit is the set) on both trained tiny models, the learned adapter, the
  plug-in field, the plug-in with tau fitted on training tasks and held-out real digits: class kept,
  diversity across seeds, distance to the nearest reference (latent units), 95% t intervals over
  sets, paired differences from the learned adapter; the learned x0 against the plug-in NW mean per
  noise level (``x0_table``);
- figures: ``outcomes.png`` (the outcome table), ``x0_vs_plug_in.png`` (the learned x0's distance to
  the NW mean over h), ``attention_vs_posterior.png`` (attention mass vs latent posterior).

$ python scripts/plug_in_field_study.py --out study            # the full run (~20-30 min on 1 core)
$ python scripts/plug_in_field_study.py --out smoke --quick    # m = 1, 2; 1 set per group; 2 seeds
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nw_adapter.commands import ScriptParser, output_folder, whole_number

MODELS = ("tiny", "tiny-flux-digits")
KINDS = ("same", "mixed")


def _parser() -> argparse.ArgumentParser:
    parser = ScriptParser(prog="plug_in_field_study.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=output_folder("--out"),
        required=True,
        help="output folder (created; must not hold another run)",
    )
    parser.add_argument(
        "--sections", default="exact,known,outcome", help="comma-separated: exact, known, outcome"
    )
    parser.add_argument("--sizes", default="1,2,4,8", help="support sizes m (1..10; default 1,2,4,8)")
    parser.add_argument(
        "--sets-per-group",
        type=whole_number("--sets-per-group", 1),
        default=10,
        help="sets per (m, same/mixed) (default 10)",
    )
    parser.add_argument(
        "--seeds", type=whole_number("--seeds", 1), default=4, help="generations per set and arm (default 4)"
    )
    parser.add_argument(
        "--steps",
        type=whole_number("--steps", 1, 1000),
        default=25,
        help="denoising steps of the outcome study (default 25)",
    )
    parser.add_argument(
        "--tasks",
        type=whole_number("--tasks", 1),
        default=40,
        help="training tasks per (m, kind) to fit tau (default 40)",
    )
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}")
    parser.add_argument(
        "--quick", action="store_true", help="m = 1, 2; 1 set per group; 2 seeds; 4 steps; 8 tasks"
    )
    return parser


def _options(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.sets_per_group, args.seeds, args.steps, args.tasks = "1,2", 1, 2, 4, 8
    try:
        args.sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes {args.sizes!r}: pass comma-separated integers, e.g. 1,2,4,8")
    args.sections = [s.strip() for s in args.sections.split(",")]
    args.models = [s.strip() for s in args.models.split(",")]
    checks = [
        (all(1 <= m <= 10 for m in args.sizes), f"--sizes {args.sizes}: each m must lie in 1..10"),
        (
            set(args.sections) <= {"exact", "known", "outcome"},
            f"--sections {args.sections}: use exact, known, outcome",
        ),
        (set(args.models) <= set(MODELS), f"--models {args.models}: use a subset of {list(MODELS)}"),
        (args.sets_per_group >= 2 or args.quick, "--sets-per-group must be >= 2 (intervals are over sets)"),
        (args.seeds >= 2, "--seeds must be >= 2 (diversity is across seeds)"),
        (args.steps >= 1 and args.tasks >= 2, "--steps must be >= 1 and --tasks >= 2"),
    ]
    for ok, message in checks:
        if not ok:
            parser.error(message)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        parser.error(f"--out {out}: exists and is not an empty folder; pass a new folder")
    return args


def _quiet() -> None:
    import warnings

    import diffusers
    import transformers

    warnings.filterwarnings("ignore")
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)


# --- exact field ---------------------------------------------------------------------------------


def exact_field_errors() -> dict[str, dict[str, float]]:
    """Max abs and relative error of the stand-in against the core field at 3 steps, random latents."""
    from diffusers import StableDiffusion3Pipeline, StableDiffusionXLPipeline

    from nw_adapter.core.kernels import nw_mean
    from nw_adapter.core.paths import NWVelocityField, SigmaFlowPath, VPPath
    from nw_adapter.integration.latent_support import encode_references, flatten_states, latent_space
    from nw_adapter.integration.nw_field import NWFieldDenoiser
    from nw_adapter.models.loaders import load_tiny_digits, load_tiny_flux_digits, tiny_digit_image
    from nw_adapter.models.tiny import save_tiny_sdxl
    from nw_adapter.models.tiny_flow import save_tiny_sd3

    digits = [tiny_digit_image(3), tiny_digit_image(7)]
    gen = torch.Generator().manual_seed(0)
    results = {}

    def stand_in(pipe, images):
        space = latent_space(pipe)
        latents = encode_references(pipe, images, height=32, width=32)
        return NWFieldDenoiser(getattr(pipe, space.denoiser), pipe, latents, space), latents

    def record(name, errors):
        results[name] = {
            "max_abs_error": max(a for a, _ in errors),
            "max_relative_error": max(r for _, r in errors),
        }

    pipe = load_tiny_digits()
    field, latents = stand_in(pipe, digits)
    exact = NWVelocityField(flatten_states(latents), VPPath(pipe.scheduler.alphas_cumprod), form="direct")
    pipe.scheduler.set_timesteps(10)
    errors = []
    for t in pipe.scheduler.timesteps[[0, 4, -1]]:
        x = torch.randn(2, *latents.shape[1:], generator=gen) * 3
        field.tracker.new_call()
        got = field(x, t, return_dict=False)[0].double().reshape(2, -1)
        want = exact(x.reshape(2, -1).double(), int(t))
        errors.append((float((got - want).abs().max()), float((got - want).abs().max() / want.abs().max())))
    record("tiny SD 1.5 digits (PNDM, epsilon)", errors)
    field.remove()

    with tempfile.TemporaryDirectory() as folder:
        sdxl = StableDiffusionXLPipeline.from_pretrained(save_tiny_sdxl(Path(folder) / "sdxl"))
        sd3 = StableDiffusion3Pipeline.from_pretrained(save_tiny_sd3(Path(folder) / "sd3"))
    images = [digits[0].resize((32, 32)), digits[1].resize((32, 32))]
    field, latents = stand_in(sdxl, images)
    scheduler = sdxl.scheduler
    scheduler.set_timesteps(8)
    x_ve = torch.randn(1, *latents.shape[1:], generator=gen) * float(scheduler.sigmas[0])
    errors = []
    for i in (0, 3, 7):
        scheduler._step_index = i
        eps = field(scheduler.scale_model_input(x_ve, scheduler.timesteps[i]), scheduler.timesteps[i])[0]
        x0 = scheduler.step(eps, scheduler.timesteps[i], x_ve).pred_original_sample.double().reshape(1, -1)
        want = nw_mean(
            x_ve.reshape(1, -1).double(), flatten_states(latents), float(scheduler.sigmas[i]), form="direct"
        )
        errors.append((float((x0 - want).abs().max()), float((x0 - want).abs().max() / x_ve.abs().max())))
    record("random tiny SDXL (Euler: the scheduler's x0 vs the NW mean; relative to |x|)", errors)
    field.remove()

    flows = (
        ("random tiny SD 3 (flow)", sd3, False),
        ("tiny Flux digits (flow, packed)", load_tiny_flux_digits(), True),
    )
    for name, pipe, packed in flows:
        pipe.scheduler.set_timesteps(6, **({"mu": 0.5} if packed else {}))
        field, latents = stand_in(pipe, images if not packed else digits)
        exact = NWVelocityField(flatten_states(latents), SigmaFlowPath(), form="direct")
        errors = []
        for i in (0, 2, 5):
            t = pipe.scheduler.timesteps[i]
            x = torch.randn(2, *latents.shape[1:], generator=gen)
            got = field(hidden_states=x, timestep=(t / 1000 if packed else t).expand(2), return_dict=False)[0]
            want = exact(x.reshape(2, -1).double(), float(pipe.scheduler.sigmas[i]))
            diff = (got.double().reshape(2, -1) - want).abs().max()
            errors.append((float(diff), float(diff / want.abs().max())))
        record(name, errors)
        field.remove()
    return results


# --- known answer --------------------------------------------------------------------------------


def known_answer(seeds: int = 8) -> dict[str, Any]:
    """Digits 3 and 7 under the plug-in field, PNDM 30 steps (the issue's prototype numbers)."""
    from diffusers import DDIMScheduler

    from nw_adapter.models.loaders import load_tiny_digits, tiny_digit_image
    from nw_adapter.pipelines import StableDiffusionNWFieldPipeline

    pipe = load_tiny_digits()
    field = StableDiffusionNWFieldPipeline.from_pipe(
        pipe, references=[tiny_digit_image(3), tiny_digit_image(7)]
    )
    field.set_progress_bar_config(disable=True)
    support = field.reference_latents().reshape(2, -1)
    runs = []
    for seed in range(seeds):
        z = field(
            num_inference_steps=30, generator=torch.Generator().manual_seed(seed), output_type="latent"
        ).images
        distances = (z.reshape(1, -1).double() - support).norm(dim=-1).tolist()
        cond = [s for s in field.posterior_steps if s["half"] == "cond"]
        runs.append(
            {
                "seed": seed,
                "distances": distances,
                "landed_on": int(np.argmin(distances)),
                "posterior_favoured_last": cond[-1]["posterior_favoured"],
                "posterior": [
                    {"step": s["step"], "h": s["h"], "w": s["posterior"], "n_eff": s["posterior_n_eff"]}
                    for s in cond
                ],
            }
        )
    ddim = {}
    for clip in (True, False):
        field.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, clip_sample=clip)
        try:
            z = field(
                num_inference_steps=30, generator=torch.Generator().manual_seed(0), output_type="latent"
            ).images
            ddim[f"clip_sample={clip}"] = (z.reshape(1, -1).double() - support).norm(dim=-1).tolist()
        except ValueError as error:
            ddim[f"clip_sample={clip}"] = f"refused: {error}"
    return {
        "references": "digits 3 and 7 (bundled held-out examples)",
        "reference_distance": float((support[0] - support[1]).norm()),
        "pndm_30_steps": runs,
        "ddim": ddim,
    }


def format_known(known: dict[str, Any]) -> str:
    lines = [f"references 3, 7: {known['reference_distance']:.2f} apart (latent units)"]
    for r in known["pndm_30_steps"]:
        firsts = r["posterior"][0]["w"]
        one_hot = next((p["step"] for p in r["posterior"] if p["n_eff"] < 1.001), None)
        lines.append(
            f"  seed {r['seed']}: distances {r['distances'][0]:.2f} / {r['distances'][1]:.2f} -> lands on "
            f"{r['landed_on']} (posterior's last favourite {r['posterior_favoured_last']}); first-step "
            f"posterior [{firsts[0]:.3f}, {firsts[1]:.3f}], n_eff < 1.001 from step {one_hot} of "
            f"{r['posterior'][-1]['step']}"
        )
    lines.append(f"  DDIM: {known['ddim']}")
    return "\n".join(lines)


# --- outcome study -------------------------------------------------------------------------------


def _pil(array: np.ndarray) -> Any:
    from PIL import Image

    return Image.fromarray(array)


def outcome_sets(sizes: list[int], per_group: int, seeds: int, seed: int = 0) -> list[Any]:
    """Support sets of held-out ``reference`` digits (same class / mixed) and their held-out control
    images from the ``judge`` split (no training stage saw either)."""
    from nw_adapter.analysis.plug_in_outcomes import OutcomeSet
    from nw_adapter.models.digits_data import load_digit_splits

    splits = load_digit_splits()
    refs, pool = splits["reference"], splits["judge"]
    by_class = {c: np.flatnonzero(refs.labels == c) for c in range(10)}
    pool_by_class = {c: np.flatnonzero(pool.labels == c) for c in range(10)}
    rng = np.random.default_rng(seed)
    sets = []
    for m in sizes:
        for kind in KINDS if m > 1 else ("same",):
            for k in range(per_group):
                if kind == "same":
                    rows = rng.choice(by_class[k % 10], size=m, replace=False)
                else:
                    rows = np.array(
                        [rng.choice(by_class[int(c)]) for c in rng.choice(10, size=m, replace=False)]
                    )
                labels = [int(refs.labels[r]) for r in rows]
                control = [int(rng.choice(pool_by_class[labels[j % m]])) for j in range(seeds)]
                images = [_pil(refs.images[r]) for r in rows]
                heldout = [_pil(pool.images[r]) for r in control]
                sets.append(OutcomeSet(f"m{m}-{kind}-{k:02d}", kind, images, labels, heldout))
    return sets


def training_tasks(m: int, kind: str, count: int, heldout: int = 8, seed: int = 1) -> list[tuple[list, list]]:
    """Tasks of the ``train`` split for fitting tau: m support digits and ``heldout`` further digits of
    the same class (same) or of the support's m classes (mixed)."""
    from nw_adapter.models.digits_data import load_digit_splits

    train = load_digit_splits()["train"]
    by_class = {c: np.flatnonzero(train.labels == c) for c in range(10)}
    rng = np.random.default_rng(seed)
    tasks = []
    for k in range(count):
        if kind == "same":
            rows = rng.choice(by_class[k % 10], size=m + heldout, replace=False)
            support, rest = rows[:m], rows[m:]
        else:
            classes = rng.choice(10, size=m, replace=False)
            support = np.array([rng.choice(by_class[int(c)]) for c in classes])
            rest = np.array(
                [rng.choice(np.setdiff1d(by_class[int(classes[j % m])], support)) for j in range(heldout)]
            )
        tasks.append(([_pil(train.images[r]) for r in support], [_pil(train.images[r]) for r in rest]))
    return tasks


def _model(name: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The pipeline and the learned / field call arguments (the model cards' settings)."""
    from nw_adapter.models.loaders import TINY_FLUX_DIGITS_CALL, load_tiny_digits, load_tiny_flux_digits

    if name == "tiny":
        return (
            load_tiny_digits(),
            {"prompt": "a photograph", "guidance_scale": 7.5},
            {"prompt": "", "guidance_scale": 1.0},
        )
    learned = {
        "prompt": "a photograph",
        "true_cfg_scale": 5.0,
        "negative_prompt": "",
        **TINY_FLUX_DIGITS_CALL,
    }
    return load_tiny_flux_digits(), learned, {"prompt": "", **TINY_FLUX_DIGITS_CALL}


def outcome_study(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    from nw_adapter.analysis.plug_in_outcomes import fit_tau, paired_differences, run_set, summarise, x0_table
    from nw_adapter.models.digits_quality import digit_judge

    judge = digit_judge()
    sets = outcome_sets(args.sizes, args.sets_per_group, args.seeds)
    seeds = list(range(args.seeds))
    document: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "models": {}}
    for name in args.models:
        pipe, learned, field = _model(name)
        learned, field = (
            {**learned, "num_inference_steps": args.steps},
            {**field, "num_inference_steps": args.steps},
        )
        taus = {}
        for m in args.sizes:
            for kind in KINDS if m > 1 else ("same",):
                taus[(m, kind)] = fit_tau(pipe, training_tasks(m, kind, args.tasks))
        log(f"{name}: tau fitted on training tasks {[(m, k, round(t, 3)) for (m, k), t in taus.items()]}")
        results = []
        start = time.monotonic()
        for i, outcome_set in enumerate(sets):
            tau = taus[(outcome_set.m, outcome_set.kind)]
            calls = {"learned_call": learned, "field_call": field}
            results.append(run_set(pipe, outcome_set, seeds=seeds, tau=tau, judge=judge, **calls))
            log(f"{name}: set {i + 1}/{len(sets)} {outcome_set.key} ({time.monotonic() - start:.0f} s)")
        document["models"][name] = {
            "scheduler": type(pipe.scheduler).__name__,
            "learned_call": learned,
            "field_call": field,
            "tau": [{"m": m, "kind": k, "tau": t} for (m, k), t in taus.items()],
            "summary": summarise(results),
            "paired_differences": paired_differences(results),
            "x0_table": x0_table(results),
            "sets": results,
        }
    return document


def outcome_csv(document: dict[str, Any]) -> str:
    from nw_adapter.analysis.records import csv_text

    rows = []
    for model, block in document["models"].items():
        for r in block["sets"]:
            for arm, metrics in r["arms"].items():
                tau = r["tau"] if arm == "plug-in, tau fitted" else None
                rows.append(
                    {"model": model, "set": r["key"], "m": r["m"], "kind": r["kind"], "arm": arm, "tau": tau}
                )
                rows[-1].update(metrics)
    return csv_text(rows, ["model", "set", "m", "kind", "arm", "tau", "class_kept", "diversity", "nearest"])


def format_outcomes(document: dict[str, Any]) -> str:
    from nw_adapter.analysis.plug_in_outcomes import format_table, format_x0_table

    parts = []
    for model, block in document["models"].items():
        taus = ", ".join(f"m={t['m']} {t['kind']}: {t['tau']:.3f}" for t in block["tau"])
        parts += [
            f"== {model} ({block['scheduler']}); tau per (m, kind): {taus}",
            format_table(block["summary"]),
        ]
        parts += ["", "arm - learned (paired over sets):", format_table(block["paired_differences"]), ""]
        parts += [
            "learned x0 vs the plug-in NW mean by noise level (cond half; per set the mean over seeds and "
            "steps):",
            format_x0_table(block["x0_table"]),
            "",
        ]
    parts.append(
        "class_kept: share of seeds whose judged class is the set's (same) or one of the set's (mixed; "
        "chance m/10); diversity: mean pairwise distance of the seeds' generated latents; nearest: distance "
        "of a generated latent to the nearest reference latent (latent units, the space of x_t); [95% t "
        "interval over sets, class_kept's clipped to [0, 1]]; held-out data: real digits of the set's "
        "classes (judge split), not judged"
    )
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = _options(parser, argv)
    _quiet()
    from nw_adapter import atomic

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    if "exact" in args.sections:
        errors = exact_field_errors()
        atomic.atomic_write_json(out / "exact_field.json", errors)
        print("exact field, stand-in vs nw_adapter.core on random latents:")
        for name, e in errors.items():
            print(f"  {name}: max abs error {e['max_abs_error']:.2e}, relative {e['max_relative_error']:.2e}")
    if "known" in args.sections:
        known = known_answer()
        atomic.atomic_write_json(out / "known_answer.json", known)
        print(format_known(known))
    if "outcome" in args.sections:
        from nw_adapter.analysis.plug_in_outcomes import attention_posterior_figure, outcome_figure, x0_figure
        from nw_adapter.analysis.records import save_figure

        document = outcome_study(args, log)
        atomic.atomic_write_json(out / "outcomes.json", document, allow_nan=True)
        atomic.atomic_write_text(out / "outcomes.csv", outcome_csv(document))
        text = format_outcomes(document)
        atomic.atomic_write_text(out / "outcomes.txt", text + "\n")
        print(text)
        names = {"tiny": "tiny SD 1.5 digits", "tiny-flux-digits": "tiny Flux digits"}
        summaries = {names[k]: v["summary"] for k, v in document["models"].items()}
        results = {names[k]: v["sets"] for k, v in document["models"].items()}
        save_figure(outcome_figure(summaries), out / "outcomes.png")
        save_figure(x0_figure(results), out / "x0_vs_plug_in.png")
        save_figure(attention_posterior_figure(results), out / "attention_vs_posterior.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
