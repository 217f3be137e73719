"""The end-to-end control's command line: its options (rows of nw_adapter.correlate.option_table) and
functions (nw_adapter.correlate.end_to_end_cli)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch
from tiny_helpers import SIZE, load_sd15, random_image

from nw_adapter.correlate.end_to_end_cli import MATCHED, MAX_DRAWS, end_to_end_meta, run_end_to_end
from nw_adapter.correlate.options import CLIError, family_problem, parse_args
from nw_adapter.integration import end_to_end
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.families import FAMILIES

torch.set_num_threads(1)


def _parse(*argv: str) -> argparse.Namespace:
    return parse_args(["--image", "ref.png", *argv])


def test_defaults_are_off_with_one_scale_matched_draw() -> None:
    args = _parse()
    assert (args.end_to_end_control, args.end_to_end_draws, args.end_to_end_seed) == (False, 1, 0)
    assert args.end_to_end_scale_match is True and args.run.name == "rho"
    assert family_problem(args, "sd3") is None and end_to_end_meta(args) is None


def test_meta_names_the_kind_draws_and_seeds() -> None:
    args = _parse("--end-to-end-control", "--end-to-end-draws", "3", "--end-to-end-seed", "7")
    assert end_to_end_meta(args) == {"kind": "end-to-end", "draws": 3, "seeds": [7, 8, 9], "matched": MATCHED}
    assert end_to_end_meta(_parse("--end-to-end-control", "--no-end-to-end-scale-match"))["matched"] is None
    assert MATCHED == end_to_end.MATCHED


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--end-to-end-draws", "0"), f"--end-to-end-draws must be between 1 and {MAX_DRAWS}, got 0"),
        (("--end-to-end-draws", "two"), "--end-to-end-draws must be a whole number, got 'two'"),
        (("--end-to-end-seed", "-1"), "--end-to-end-seed must be between 0 and"),
    ],
)
def test_bad_values_are_one_line_errors(argv, message) -> None:
    with pytest.raises(CLIError, match=message.replace("(", r"\(")) as error:
        _parse("--end-to-end-control", *argv)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--end-to-end-control", "--mode", "swap"), "--mode is not read by the end-to-end control run"),
        (("--end-to-end-control", "--store-maps"), "--store-maps is not read by the end-to-end control run"),
        (("--end-to-end-control", "--control-draws", "2"), "use --end-to-end-draws"),
        (
            (
                "--end-to-end-draws",
                "2",
            ),
            "--end-to-end-draws is not read by the rho run",
        ),
    ],
)
def test_combinations_that_cannot_run_are_named(argv, message) -> None:
    with pytest.raises(CLIError, match=message) as error:
        _parse(*argv)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda row: row.name)
def test_the_families_it_runs_on_are_the_registrys(family) -> None:
    """The refusal reads the row's end_to_end field (SD 3.5's: its keys pass a per-head RMSNorm)."""
    problem = family_problem(_parse("--end-to-end-control"), family.name)
    assert (problem is not None) == (family.end_to_end is not None) == (family.name == "sd3")
    assert problem is None or (family.label in problem and family.end_to_end in problem)


def test_argument_handling_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from nw_adapter.correlate.options import parse_args\n"
        "parse_args(['--image', 'ref.png', '--end-to-end-control'])\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_run_end_to_end_returns_the_trained_output_and_merged_records(
    tiny_sd15_dir, tiny_ip_adapter_dir
) -> None:
    pipe = load_sd15(tiny_sd15_dir, tiny_ip_adapter_dir, "base")
    kwargs = dict(
        prompt="a cat", ip_adapter_image=random_image(1), num_inference_steps=2, height=SIZE, width=SIZE,
        output_type="pt",
    )  # fmt: skip
    stock = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    args = _parse("--end-to-end-control", "--end-to-end-draws", "2")
    result = run_end_to_end(
        args, pipe, NWProcessorConfig(), dict(kwargs, generator=torch.Generator().manual_seed(0))
    )
    output, records, meta = result.trained_output, result.records, result.control
    assert torch.equal(output.images, stock)
    assert meta["seeds"] == [0, 1] and meta["kind"] == "end-to-end"
    assert records and all({"rho_control_0", "rho_control_1", "key_scale_1"} <= set(r) for r in records)
