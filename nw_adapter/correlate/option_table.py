"""``correlate.py``'s two tables: its runs (:data:`RUNS`) and its options (:data:`OPTIONS`).

A new option is one row of :data:`OPTIONS` and the code of the run that reads it; a new run is
one row of :data:`RUNS` (a module with ``run(args) -> int``) and its name in the ``runs`` of the
options it reads. What the rows mean: :mod:`~nw_adapter.correlate.option_rows`; what derives from
them (the parser, the refusals, the options record, the fingerprint):
:mod:`~nw_adapter.correlate.options`. Standard library only: ``--help`` answers before torch loads.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from nw_adapter.correlate import option_values as values
from nw_adapter.correlate.end_to_end_cli import MAX_DRAWS as MAX_END_TO_END_DRAWS
from nw_adapter.correlate.loading import DTYPES, SCHEDULERS
from nw_adapter.correlate.option_rows import (
    COMPARE_SWAP,
    END_TO_END,
    OMIT,
    REPLOT,
    RHO,
    SUPPORT_SETS,
    Needs,
    Option,
    Record,
    Resolved,
    Run,
)
from nw_adapter.correlate.spec import DEFAULT_IP_ADAPTER, DEFAULT_MODEL, EXAMPLE_DIR
from nw_adapter.integration import families as registry
from nw_adapter.integration.config import BANDWIDTH_RULES, MAX_CONTROL_DRAWS
from nw_adapter.integration.families import Family, families_where

__all__ = ["EVERY_RUN", "MODEL_RUNS", "OPTIONS", "OPTION_BY_DEST", "RUNS", "RUN_BY_NAME"]


def _resolved(name: str):
    """The record value ``resolved.<name>`` (what the run resolved, not the option as given)."""
    return lambda args, resolved: getattr(resolved, name)


def _call(name: str):
    """The record value of the pipeline call's family argument ``name``, left out when the call has none."""
    return lambda args, resolved: resolved.call.get(name, OMIT)


def _families(rows: Sequence[Family]) -> frozenset[str]:
    """The names of registry rows (an option's :attr:`~nw_adapter.correlate.option_rows.Option.families`)."""
    return frozenset(row.name for row in rows)


def _listed(words: Sequence[str], conjunction: str = "and") -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    words = list(words)
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {conjunction} {words[-1]}"


def _labels(rows: Sequence[Family], conjunction: str = "and") -> str:
    return _listed([row.label for row in rows], conjunction)


def _per_family(rows: Sequence[Family], field: str) -> str:
    """``<row's field> for <row's label>``, over the rows: the families' defaults in ``--help``."""
    return "; ".join(f"{getattr(row, field)} for {row.label}" for row in rows)


_TRUE_CFG = families_where(lambda row: row.true_cfg)
_RESCALED = families_where(lambda row: row.guidance_rescale)
_OWN_ADAPTER = families_where(lambda row: row.ip_adapter is not None)  # their own default adapter
_OWN_ENCODER = families_where(lambda row: row.encoder_argument is not None)  # a separate image encoder
_TINY = _listed(registry.tiny_models(), "or")
_DIGITS = ", ".join(registry.tiny_models(trained=True))
"""The embedded models of ``--model``, and those trained on digits (the registry's rows)."""

POSTERIOR_SPACE = "x_t's: w_i = softmax_i(-||x_t - a_t s_i||^2 / 2 b_t^2), s_i references' latents"
"""What the support-set run's posterior columns are (recorded in support.json's options)."""
_NO_REFERENCE = "no reference image given; pass --image FILE or --image-dir FOLDER (or --support-set A,B)"

RUNS: tuple[Run, ...] = (
    Run(
        name=RHO,
        title="the rho run",
        selectors=(),
        module="nw_adapter.correlate.rho_cli",
        inputs=("image", "image_dir"),
        no_input=_NO_REFERENCE,
        resumes=True,
        kept="finished images are kept, rerun the same command to resume",
        writes="rho.json, rho.csv, rho.png, bandwidth.png, images/<key>/",
    ),
    Run(
        name=END_TO_END,
        title="the end-to-end control run (--end-to-end-control)",
        selectors=("end_to_end_control",),
        module="nw_adapter.correlate.rho_cli",
        inputs=("image", "image_dir"),
        no_input=_NO_REFERENCE,
        family_limit="end_to_end",
        family_fix="drop --end-to-end-control and use the per-layer control",
        resumes=True,
        kept="finished images are kept, rerun the same command to resume",
        writes="as the rho run, with the end-to-end control's columns",
    ),
    Run(
        name=COMPARE_SWAP,
        title="the compare-swap run (--compare-swap)",
        selectors=("compare_swap",),
        module="nw_adapter.correlate.swap_cli",
        inputs=("image", "image_dir"),
        no_input=_NO_REFERENCE,
        one_process="its rows pair references with consecutive seeds",
        resumes=True,
        kept="an unfinished comparison is not kept, rerun it",
        writes="compare_swap.json, compare_swap.csv",
        records=(Record("judge", frozenset({COMPARE_SWAP}), value=_resolved("judge")),),
    ),
    Run(
        name=SUPPORT_SETS,
        title="the support-set run (--support-set/--support-dir)",
        selectors=("support_set", "support_dir"),
        module="nw_adapter.correlate.support_cli",
        family_limit="support_sets",
        family_fix="use a model of " + _labels(families_where(lambda row: row.support_sets is None), "or"),
        kept="an unfinished support-set run is not kept (its files are removed), rerun it",
        writes="support.json, support.csv, support_mass.png, sets/<key>/",
        records=(
            Record(
                "posterior_space",
                frozenset({SUPPORT_SETS}),
                value=lambda args, _: POSTERIOR_SPACE,
            ),
            Record("judge", frozenset({SUPPORT_SETS}), value=_resolved("judge")),
        ),
    ),
    Run(
        name=REPLOT,
        title="--replot (a redraw of a finished run)",
        selectors=("replot",),
        module="nw_adapter.correlate.outputs",
        one_process="it redraws one folder",
        kept="rerun --replot",
        writes="the files of the run it redraws",
    ),
    # H1 (issue 42): the calibration run is one more row here (module nw_adapter.correlate.calibrate_cli).
)
RUN_BY_NAME: dict[str, Run] = {run.name: run for run in RUNS}

MODEL_RUNS = frozenset({RHO, END_TO_END, COMPARE_SWAP, SUPPORT_SETS})
REFERENCE_RUNS = frozenset({RHO, END_TO_END, COMPARE_SWAP})
RHO_RUNS = frozenset({RHO, END_TO_END})
EVERY_RUN = frozenset(RUN_BY_NAME)


class ExampleDir(argparse.Action):
    """``--example-dir``: print the folder of the bundled example references and exit (like ``--version``)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.pop("default", None)
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(EXAMPLE_DIR)
        parser.exit()


def _per_layer_control(args: argparse.Namespace) -> bool:
    """The per-layer untrained-adapter control: on unless turned off, and not beside the end-to-end one."""
    return bool(args.untrained_control) and not args.end_to_end_control


def _end_to_end_meta(args: argparse.Namespace, _: Resolved) -> dict | None:
    from nw_adapter.correlate.end_to_end_cli import end_to_end_meta

    return end_to_end_meta(args)


def _calibration_meta(args: argparse.Namespace, _: Resolved) -> dict | None:
    from nw_adapter.correlate.calibrate_cli import calibrate_meta

    return calibrate_meta(args)


_REFERENCES = "reference images"
_MODEL = "model"
_GENERATION = "generation"
_NW = "NW comparison"
_OUTPUT = "output"
_SWAP = "swap consequence (instead of the rho run)"
_SUPPORT = "support sets (instead of the rho run)"
_END_TO_END = "end-to-end control"
_CALIBRATION = "calibration"

OPTIONS: tuple[Option, ...] = (
    # reference images
    Option(
        ("--image",), _REFERENCES, "reference image (repeatable)", REFERENCE_RUNS, action="append",
        default=[], metavar="FILE",
        parse=values.nonempty_path("--image", "pass a path (use . for the current folder)"),
        hints={SUPPORT_SETS: "the sets name their references: drop --image"},
    ),
    Option(
        ("--image-dir",), _REFERENCES, "folder of reference images, non-recursive (repeatable)",
        REFERENCE_RUNS, action="append", default=[], metavar="DIR",
        parse=values.nonempty_path("--image-dir", "pass a path (use . for the current folder)"),
        hints={SUPPORT_SETS: "the sets name their references: drop --image-dir"},
    ),
    Option(
        ("--example-dir",), _REFERENCES,
        "print the folder of the bundled held-out digits digit_0.png ... digit_9.png (references for "
        f'the digits models: --model {_DIGITS}) and exit; e.g. --image-dir "$(%(prog)s --example-dir)"',
        EVERY_RUN, action=ExampleDir,
    ),
    # model
    Option(
        ("--model",), _MODEL,
        f"diffusers pipeline: Hub id, local folder, or an embedded model (default {DEFAULT_MODEL}); "
        + _listed([f"{row.label} (e.g. {row.example_pipeline})" for row in _OWN_ADAPTER])
        + " pipelines are recognised from the pipeline and get their family's adapter; offline, embedded: "
        + ", ".join(f"{tiny.name} ({tiny.label})" for tiny in registry.TINY_MODELS),
        MODEL_RUNS, default=DEFAULT_MODEL,
        parse=values.model_name("--model", f"pass a Hub id, a local folder or {_TINY}"),
        records=(Record("model", MODEL_RUNS, value=_resolved("model")),),
    ),
    Option(
        ("--ip-adapter",), _MODEL,
        f"IP-Adapter repository: Hub id, local folder, or 'tiny' (default {DEFAULT_IP_ADAPTER}; "
        f"{_per_family(_OWN_ADAPTER, 'ip_adapter')}; the embedded adapter with --model {_TINY})",
        MODEL_RUNS,
        parse=values.model_name("--ip-adapter", "pass a Hub id, a local folder or tiny, or omit it"),
    ),
    Option(
        ("--subfolder",), _MODEL,
        f"adapter subfolder (default models, sdxl_models for SDXL, none for {_labels(_OWN_ADAPTER)})",
        MODEL_RUNS,
    ),
    Option(
        ("--weight-name",), _MODEL,
        "weight file (default ip-adapter_sd15.safetensors; ip-adapter_sdxl.safetensors for SDXL; "
        f"{_per_family(_OWN_ADAPTER, 'weight_name')})",
        MODEL_RUNS,
    ),
    Option(
        ("--image-encoder",), _MODEL,
        f"image encoder of {_labels(_OWN_ENCODER)} adapters: Hub id or local folder (default "
        f"{_per_family(_OWN_ENCODER, 'image_encoder')})",
        MODEL_RUNS, families=_families(_OWN_ENCODER),
        family_fix="their adapter repository holds the image encoder: drop --image-encoder",
    ),
    Option(
        ("--scheduler",), _MODEL, "default: the model's own", MODEL_RUNS, choices=tuple(sorted(SCHEDULERS)),
        families=_families(families_where(lambda row: not row.flow)),
        family_fix="a flow-matching model keeps its own scheduler (its sigma schedule is part of the "
        "model): drop --scheduler",
        records=(
            Record("scheduler", MODEL_RUNS),
            Record("scheduler_class", MODEL_RUNS, value=_resolved("scheduler_class"),
                 fingerprinted=RHO_RUNS),
        ),
    ),
    Option(
        ("--device",), _MODEL, "auto (cuda > mps > cpu), cpu, mps, cuda, cuda:N", MODEL_RUNS, default="auto",
        parse=values.device, records=(Record("device", MODEL_RUNS, value=_resolved("device")),),
    ),
    Option(
        ("--dtype",), _MODEL, "auto: float16 on CUDA, float32 else", MODEL_RUNS, default="auto",
        choices=DTYPES,
        records=(Record("dtype", MODEL_RUNS, value=_resolved("dtype")),),
    ),
    # generation
    Option(
        ("--prompt",), _GENERATION, "text prompt (default 'a photograph'; '' for none)", MODEL_RUNS,
        default="a photograph", records=(Record("prompt", MODEL_RUNS),),
    ),
    Option(
        ("--negative-prompt",), _GENERATION, "negative prompt", MODEL_RUNS,
        records=(Record("negative_prompt", MODEL_RUNS),),
    ),
    Option(
        ("--steps",), _GENERATION, "default 50", MODEL_RUNS, default=50,
        parse=values.positive_int("--steps", maximum=1000), records=(Record("steps", MODEL_RUNS),),
    ),
    Option(
        ("--seed",), _GENERATION, "seed of the generation and the nulls (default 0)", MODEL_RUNS, default=0,
        parse=values.seed("--seed"), records=(Record("seed", MODEL_RUNS),),
    ),
    Option(
        ("--guidance-scale",), _GENERATION, "default 7.5", MODEL_RUNS, default=7.5,
        parse=values.nonneg_float("--guidance-scale"), records=(Record("guidance_scale", MODEL_RUNS),),
    ),
    Option(
        ("--ip-scale",), _GENERATION, "IP-Adapter scale (1.0)", MODEL_RUNS, default=1.0,
        parse=values.nonneg_float("--ip-scale"), records=(Record("ip_scale", MODEL_RUNS),),
    ),
    Option(
        ("--guidance-rescale",), _GENERATION,
        f"{_labels(_RESCALED)}: mix the guided noise prediction rescaled to the conditional one's standard "
        "deviation by this factor, 0 to 1 (diffusers' guidance_rescale, Lin et al. 2023, against "
        "over-exposure; default 0, off)",
        MODEL_RUNS, default=0.0, parse=values.nonneg_float("--guidance-rescale", maximum=1.0),
        families=_families(_RESCALED),
        family_fix="its pipeline takes no guidance_rescale: drop --guidance-rescale",
        needs=Needs("guidance_scale", lambda scale: scale > 1, "--guidance-rescale rescales classifier-free "
                    "guidance, which --guidance-scale <= 1 turns off; raise --guidance-scale or drop "
                    "--guidance-rescale", "with --guidance-scale > 1"),
        records=(Record("guidance_rescale", MODEL_RUNS, omit_default=True),),
    ),
    Option(
        ("--true-cfg-scale",), _GENERATION,
        f"{_labels(_TRUE_CFG)} only: true classifier-free guidance with --negative-prompt when > 1 (two "
        "transformer passes per step, reported as the cond / uncond halves); default 1.0",
        MODEL_RUNS, default=1.0, parse=values.nonneg_float("--true-cfg-scale"), families=_families(_TRUE_CFG),
        family_fix=f"only {_labels(_TRUE_CFG, 'and')} pipelines have true classifier-free guidance: use "
        "--guidance-scale",
        records=(  # the rho run records the Flux call's arguments (below), the others the option
            Record("true_cfg_scale", MODEL_RUNS - RHO_RUNS),
            Record("true_cfg_scale", RHO_RUNS, value=_call("true_cfg_scale")),
            Record("max_sequence_length", RHO_RUNS,
                 value=_call("max_sequence_length")),
        ),
    ),
    Option(
        ("--height",), _GENERATION, "pixels, multiple of 8 (default: the model's)", MODEL_RUNS,
        parse=values.size("--height"), records=(Record("height", MODEL_RUNS),),
    ),
    Option(
        ("--width",), _GENERATION, "pixels, multiple of 8 (default: the model's)", MODEL_RUNS,
        parse=values.size("--width"), records=(Record("width", MODEL_RUNS),),
    ),
    # NW comparison
    Option(
        ("--mode",), _NW, "observe (output unchanged) or swap the image branch for the exact NW head",
        frozenset({RHO}), default="observe", choices=("observe", "swap"),
        records=(Record("mode", RHO_RUNS),),
        hints={
            COMPARE_SWAP: "it generates stock and NW-head images itself (the rules go in --swap-rules): drop "
            "--mode",
            SUPPORT_SETS: "it observes the stock generation: drop --mode",
            END_TO_END: "it compares the statistics of two observed generations: drop --mode",
        },
    ),
    Option(
        ("--bandwidth",), _NW, "matched | fitted | schedule | median | a positive number h (default matched)",
        RHO_RUNS, default="matched", parse=values.bandwidth, records=(Record("bandwidth", RHO_RUNS),),
        hints={
            COMPARE_SWAP: "it swaps in the NW head under each rule of --swap-rules: pass them there",
            SUPPORT_SETS: "its posterior over the references' latents (the space of x_t) uses the "
            "schedule's h = sigma_t / alpha_t, and it computes no NW weights in the head's q/k space: "
            "drop --bandwidth",
        },
    ),
    Option(
        ("--layers",), _NW,
        "comma-separated blocks (down, mid, up for UNets; transformer_blocks for transformers) or "
        "attention-processor name prefixes",
        RHO_RUNS | {SUPPORT_SETS}, parse=values.layers,
        records=(Record("layers", RHO_RUNS | {SUPPORT_SETS}),),
        hints={COMPARE_SWAP: "it swaps every IP-Adapter layer: drop --layers"},
    ),
    Option(
        ("--no-untrained-control",), _NW,
        "skip the scale-matched untrained-adapter control (the same queries against the keys of the "
        "IP-Adapter training recipe's initialisation, rescaled to the trained keys' RMS norm; "
        "{X}_control_{k} and key_scale_{k} columns; on by default; docs/controls.md)",
        frozenset({RHO}), action="store_false", dest_name="untrained_control", default=True,
        records=(Record("untrained_control", RHO_RUNS, value=lambda args, _: _per_layer_control(args)),),
        hints={END_TO_END: "the end-to-end control replaces the per-layer one: drop --no-untrained-control"},
    ),
    Option(
        ("--control-draws",), _NW,
        "number of untrained-adapter control draws, seeded --untrained-seed + k (default 3)",
        frozenset({RHO}),
        default=3, metavar="K", parse=values.positive_int("--control-draws", maximum=MAX_CONTROL_DRAWS),
        needs=Needs("untrained_control", True, "--control-draws sets the untrained-adapter control, which "
                    "--no-untrained-control turns off; drop one of them", "with the control on"),
        records=(Record("untrained_draws", RHO_RUNS,
                      value=lambda args, _: args.control_draws if _per_layer_control(args) else None),),
        hints={END_TO_END: "the end-to-end control has its own: use --end-to-end-draws"},
    ),
    Option(
        ("--untrained-seed",), _NW, "seed s of the untrained adapters' initialisation: draw k uses s + k "
        "(default 0)", frozenset({RHO}), default=0, parse=values.seed("--untrained-seed"),
        needs=Needs("untrained_control", True, "--untrained-seed seeds the untrained-adapter control, which "
                    "--no-untrained-control turns off; drop one of them", "with the control on"),
        records=(Record("untrained_seed", RHO_RUNS,
                      value=lambda args, _: args.untrained_seed if _per_layer_control(args) else None),),
        hints={END_TO_END: "the end-to-end control has its own: use --end-to-end-seed"},
    ),
    # output
    Option(
        ("--out",), _OUTPUT, "output folder (default ./correlate_out)", MODEL_RUNS, default="correlate_out",
        parse=values.nonempty_path("--out", "pass a folder path (e.g. --out correlate_out)"),
        hints={REPLOT: "it rewrites the files of the folder it redraws: drop --out"},
    ),
    Option(
        ("--store-maps",), _OUTPUT,
        "keep attention and NW maps at the reported steps; draw attention_maps.png",
        frozenset({RHO}), action="store_true", default=False, records=(Record("store_maps", RHO_RUNS),),
        hints={END_TO_END: "run them separately"},
    ),
    Option(
        ("--all-steps",), _OUTPUT, "table of every step, not only the paper's five", RHO_RUNS | {REPLOT},
        action="store_true", default=False,
    ),
    Option(
        ("--replot",), _OUTPUT,
        "redraw the table, verdict and figures of a finished run in OUT from its saved files (rho.json, "
        "maps.safetensors, generated.png), without loading a model; no --image needed",
        frozenset({REPLOT}), metavar="OUT",
        parse=values.nonempty_path("--replot", "pass the --out folder of a finished run"),
    ),
    Option(
        ("-q", "--quiet"), _OUTPUT,
        "-q: no progress bars; -qq: no notes either (errors, the table and the verdict remain). Progress "
        "bars are drawn only when stderr is a terminal",
        EVERY_RUN, action="count", default=0,
    ),
    Option(
        ("-v", "--verbose"), _OUTPUT,
        "print everything: the full verdict (every part's interval, p and n), the calibrated table, the "
        "legends, the per-set lines of a support-set run; and the libraries' own warnings and notes",
        EVERY_RUN,
        action="store_true", default=False,
    ),
    # compare-swap
    Option(
        ("--compare-swap",), _SWAP,
        "generate every reference under stock and under the exact NW head (each --swap-rules rule, same "
        "seed) and report the pixel change, its other-seed control, CLIP-I and, with known classes, class "
        "agreement, with 95%% intervals over references; writes compare_swap.json/.csv, no rho run",
        frozenset({COMPARE_SWAP}), action="store_true", default=False,
    ),
    Option(
        ("--swap-rules",), _SWAP,
        f"comma-separated bandwidth rules or numbers h (default {','.join(BANDWIDTH_RULES)})",
        frozenset({COMPARE_SWAP}), metavar="RULES", parse=values.swap_rules,
        records=(Record("rules", frozenset({COMPARE_SWAP}),
                      value=lambda args, _: list(args.swap_rules or BANDWIDTH_RULES)),),
    ),
    Option(
        ("--labels",), _SWAP,
        f"--compare-swap with a digits model (--model {_DIGITS}): the references' digit classes, "
        "comma-separated, in the order the references are listed (the bundled held-out digits are "
        "recognised without it)",
        frozenset({COMPARE_SWAP}), metavar="DIGITS", parse=values.labels,
        records=(Record("labels", frozenset({COMPARE_SWAP}), value=_resolved("labels")),),
    ),
    # support sets
    Option(
        ("--support-set",), _SUPPORT,
        "one generation conditioned on these reference images together (comma-separated, one adapter; "
        "repeatable: one set each); reports the attention mass per reference over denoising beside the "
        "posterior over the references' latents (in x_t's space), and which reference the image resembles; "
        "writes support.json/.csv",
        frozenset({SUPPORT_SETS}), action="append", default=[], metavar="FILES", parse=values.support_set,
    ),
    Option(
        ("--support-dir",), _SUPPORT, "every subfolder of DIR holding images is one support set (repeatable)",
        frozenset({SUPPORT_SETS}), action="append", default=[], metavar="DIR",
        parse=values.nonempty_path("--support-dir", "pass a folder whose subfolders hold the sets"),
    ),
    # end-to-end control
    Option(
        ("--end-to-end-control",), _END_TO_END,
        "generate every reference K more times with the untrained adapter in every layer (same seed and "
        "noise) and record those passes' statistics as {stat}_control_{k} columns; costs K more generations "
        f"per image ({_labels(families_where(lambda row: row.end_to_end is None))})",
        frozenset({END_TO_END}), action="store_true", default=False,
        records=(Record("end_to_end_control", RHO_RUNS, value=_end_to_end_meta),),
    ),
    Option(
        ("--end-to-end-draws",), _END_TO_END,
        f"control draws of the end-to-end control, 1 to {MAX_END_TO_END_DRAWS} (default 1)",
        frozenset({END_TO_END}), default=1, metavar="K",
        parse=values.positive_int("--end-to-end-draws", maximum=MAX_END_TO_END_DRAWS),
    ),
    Option(
        ("--end-to-end-seed",), _END_TO_END,
        "seed of the end-to-end control's draw 0 (draw k: S + k; default 0)",
        frozenset({END_TO_END}), default=0, metavar="S",
        parse=values.seed("--end-to-end-seed", room=MAX_END_TO_END_DRAWS),
    ),
    Option(
        ("--no-end-to-end-scale-match",), _END_TO_END,
        "keep the untrained keys and values at their own scale (default: rescaled per layer and head to the "
        "trained RMS norms, so a pure change of scale reads as no effect)",
        frozenset({END_TO_END}), action="store_false", dest_name="end_to_end_scale_match", default=True,
    ),
    # calibration: the exact NW head measured in the same pipeline
    Option(
        ("--calibrate",), _CALIBRATION,
        "generate every reference again with the exact NW head at the schedule's h swapped in (same seed and "
        "noise) and measure it as the verdict's anchor beside the adapter and the control: the calibrated "
        "table, the exact head's own verdict, its line in bandwidth.png (one more generation per image)",
        frozenset({RHO}), action="store_true", default=False,
        needs=(
            Needs("mode", "observe", "--calibrate needs --mode observe: its second pass swaps the exact NW "
                  "head in itself; drop --mode swap", "in observe mode"),
            Needs("store_maps", False, "--calibrate does not combine with --store-maps; run them separately",
                  "without --store-maps"),
        ),
        records=(Record("calibration", RHO_RUNS, value=_calibration_meta, omit_default=True),),
        hints={
            END_TO_END: "--calibrate does not combine with --end-to-end-control (both add passes); run them "
            "separately",
            COMPARE_SWAP: "--calibrate applies to the rho run (--image / --image-dir): drop it",
            SUPPORT_SETS: "--calibrate applies to the rho run (--image / --image-dir): drop it",
            REPLOT: "a redraw generates nothing; --calibrate applies to the rho run: drop it",
        },
    ),
    Option(
        ("--calibrate-c",), _CALIBRATION, "the exact head's bandwidth h = C sigma_t / alpha_t (default 1)",
        frozenset({RHO}), default=None, metavar="C", parse=values.positive_float("--calibrate-c"),
        needs=Needs("calibrate", True, "--calibrate-c sets the exact head's bandwidth of --calibrate; add "
                    "--calibrate or drop it", "with --calibrate"),
    ),
)  # fmt: skip
"""Every option of ``correlate.py``, in ``--help`` order."""

OPTION_BY_DEST: dict[str, Option] = {option.dest: option for option in OPTIONS}
