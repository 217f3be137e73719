"""A side computation that fails in every layer of a step is an error the user sees (issue 30, item 3).

Not only the one RuntimeWarning: ``NWRecorder.summary()`` prints one ``error:`` line above its
table naming the steps without statistics, and the command line prints it on stderr (also with
``-qq``). A step where some layers still recorded is a note, not this error.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from diffusers import StableDiffusionPipeline
from tiny_helpers import generate, random_image

from nw_adapter.correlate.cli import PROG, main
from nw_adapter.integration.control import UntrainedControl
from nw_adapter.integration.mixin import apply_nw_processor, remove_nw_processor
from nw_adapter.models.tiny import ip_adapter_weight_name

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def sd15(tiny_sd15_dir, tiny_ip_adapter_dir):
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd15_dir)
    pipe.load_ip_adapter(tiny_ip_adapter_dir, subfolder="models", weight_name=ip_adapter_weight_name("base"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run_with_broken_control(pipe, broken_layers: set[str] | None) -> object:
    """Generate 2 steps with the control failing in ``broken_layers`` (None: every layer)."""
    recorder = apply_nw_processor(pipe, untrained_control=True)
    control = next(p.untrained_control for p in pipe.unet.attn_processors.values()
                   if getattr(p, "untrained_control", None) is not None)  # fmt: skip
    keys = control.keys

    def failing(layer, states, *, adapter=0, draw=0):
        if broken_layers is None or layer in broken_layers:
            raise RuntimeError("control broke")
        return keys(layer, states, adapter=adapter, draw=draw)

    control.keys = failing
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            generate(pipe, steps=2)
    finally:
        remove_nw_processor(pipe)
    return recorder


def test_summary_names_the_steps_that_failed_in_every_layer(sd15) -> None:
    recorder = _run_with_broken_control(sd15, None)
    assert recorder.to_records() == []
    steps = sorted({p["step"] for p in recorder.skipped()["pairs"]})  # PNDM: 3 forwards for 2 steps
    assert len(steps) >= 2 and [(f["call"], f["step"]) for f in recorder.failed_steps()] == [
        (0, s) for s in steps
    ]
    summary = recorder.summary()
    assert summary.error == (
        f"the NW side computation failed in every layer of {len(steps)} step(s) (call 0: steps "
        f"{', '.join(map(str, steps))}; RuntimeError: control broke): those steps have no statistics; "
        "see recorder.skipped()"
    )
    assert str(summary).splitlines()[0] == f"error: {summary.error}"


def test_a_step_where_some_layers_recorded_is_no_error(sd15) -> None:
    layer = next(n for n, p in sd15.unet.attn_processors.items() if hasattr(p, "to_k_ip"))
    recorder = _run_with_broken_control(sd15, {layer})
    assert recorder.skipped()["count"] >= 2 and recorder.to_records()
    assert recorder.failed_steps() == [] and recorder.summary().error is None
    assert not str(recorder.summary()).startswith("error:")


@pytest.mark.parametrize("quiet", ["-q", "-qq"])
def test_cli_prints_the_failed_steps_as_one_error_line(
    quiet, tiny_sd15_dir, tiny_ip_adapter_dir, tmp_path, capsys, monkeypatch
) -> None:
    def broken(self, layer, states, *, adapter=0, draw=0):
        raise RuntimeError("control broke")

    monkeypatch.setattr(UntrainedControl, "keys", broken)
    reference = tmp_path / "ref.png"
    random_image(3, 48).save(reference)
    argv = ["--image", reference, "--model", tiny_sd15_dir, "--ip-adapter", tiny_ip_adapter_dir,
            "--steps", "2", "--scheduler", "ddim", quiet, "--out", tmp_path / "out"]  # fmt: skip
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error" in line]
    assert errors == [
        "error: ref.png: the NW side computation failed in every layer of 2 step(s) (call 0: steps 0, 1; "
        "RuntimeError: control broke): those steps have no statistics",
        f"{PROG}: error: no statistics were recorded for any of the 1 image(s): the NW side "
        "computation failed in every layer (see the error line(s) above); nothing to report",
    ], err
