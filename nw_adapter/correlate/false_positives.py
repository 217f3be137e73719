"""How often the verdict says "evidence" on random-weight models, where nothing was learned.

:func:`count_verdicts` runs ``correlate.py`` (:func:`nw_adapter.correlate.cli.main`, in process) on a
random tiny model (SD 1.5 with a random adapter, SD 3.5, Flux) once per seed, each run over the same
few reference images (scikit-learn's sample photographs and their mirror images), each seed a new
draw of all the model's weights, with the scale-matched untrained-adapter control on
(:data:`CONTROL_DRAWS` draws per run, seeds that no other run uses), and counts the
runs whose verdict is "evidence of kernel smoothing on the schedule" (the positive conclusion:
the exponent equivalent to the theory's 2 and above the control's, and the NW form) and the runs
in which each clause holds or was measured. The weights are random, so every "evidence" is a false
positive; the verdict's design bounds its rate by alpha = 5% per run (each condition is an
intersection-union test of size at most alpha). Entry point:
``scripts/verdict_false_positives.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from nw_adapter.integration.families import tiny_models

CONTROL_DRAWS = 3
"""Control draws per run (``--control-draws``, the command line's default)."""

MODELS: tuple[str, ...] = ("tiny-sd15-random", *tiny_models(trained=False))
"""Random-weight models: ``tiny-sd15-random`` is built here (SD 1.5 layout + a random base adapter), the
others are the registry's random-weight embedded models (``tiny-sd3``, ``tiny-flux``)."""


def reference_images(folder: Path, count: int) -> list[Path]:
    """``count`` (<= 4) reference photographs: scikit-learn's two samples and their mirror images."""
    from PIL import Image
    from sklearn.datasets import load_sample_image

    folder.mkdir(parents=True, exist_ok=True)
    arrays = [load_sample_image(name) for name in ("china.jpg", "flower.jpg")]
    arrays += [a[:, ::-1].copy() for a in arrays]
    paths = []
    for index, array in enumerate(arrays[:count]):
        path = folder / f"reference_{index}.png"
        Image.fromarray(array).save(path)
        paths.append(path)
    return paths


def model_arguments(model: str, folder: Path, seed: int) -> list[str]:
    """The ``correlate.py`` model options of the random model of ``seed`` (written once in ``folder``).

    Every seed is another draw of ALL the weights (denoiser, image encoder, adapter), so the runs
    are independent models; the untrained-adapter control (on by default) is seeded apart too (run
    ``seed``'s draws use seeds ``seed * CONTROL_DRAWS + k``, :func:`count_verdicts`).
    """
    if model == "tiny-sd15-random":
        from nw_adapter.models.tiny import save_tiny_ip_adapter, save_tiny_sd15, write_once

        pipeline = write_once(folder / f"sd15-seed{seed}", lambda p: save_tiny_sd15(p, seed=seed))
        adapter = write_once(
            folder / f"sd15-ip-adapter-seed{seed}",
            lambda p: save_tiny_ip_adapter(p, variant="base", sdxl=False, seed=seed),
        )
        return ["--model", str(pipeline), "--ip-adapter", str(adapter)]
    from nw_adapter.correlate.families import ensure_tiny_flow_models
    from nw_adapter.integration.families import family_named, tiny_model

    family = family_named(tiny_model(model).family)
    pipeline, adapter, encoder = ensure_tiny_flow_models(family, folder, seed=seed)
    return ["--model", str(pipeline), "--ip-adapter", str(adapter), "--image-encoder", str(encoder)]


def count_verdicts(model: str, *, seeds: int, images: int, steps: int, out: Path) -> dict[str, int]:
    """Run ``correlate.py`` once per seed on ``model``; count "evidence" and each clause that holds."""
    from nw_adapter.correlate.cli import main

    references = reference_images(out / "references", images)
    counts = {"runs": 0, "evidence": 0}
    for seed in range(seeds):
        run_dir = out / model / f"seed{seed}"
        options = model_arguments(model, out / "models", seed)
        argv = [
            *options,
            "--untrained-seed",
            str(seed * CONTROL_DRAWS),  # draw k: seed * K + k, never a seed of another run
            "--control-draws",
            str(CONTROL_DRAWS),
            "--steps",
            str(steps),
            "--seed",
            str(seed),
            "-qq",
            "--out",
            str(run_dir),
        ]
        for path in references:
            argv += ["--image", str(path)]
        with contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        if code != 0:
            raise SystemExit(f"{model} seed {seed}: correlate.py exited with {code}")
        result = json.loads((run_dir / "rho.json").read_text())["verdict"]
        counts["runs"] += 1
        counts["evidence"] += result["evidence"] is True
        for key, clause in result["clauses"].items():
            counts[f"{key} holds"] = counts.get(f"{key} holds", 0) + (clause["holds"] is True)
            counts[f"{key} measured"] = counts.get(f"{key} measured", 0) + (clause["holds"] is not None)
    return counts
