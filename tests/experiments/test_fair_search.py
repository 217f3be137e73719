"""scripts/run_fair_baseline_search.py: its options, its test of OFF against the plug-in, its rows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nw_adapter.experiments.evaluation import EvalConfig, evaluate_methods
from nw_adapter.experiments.fields import plugin_field

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "run_fair_baseline_search.py"


@pytest.fixture(scope="module")
def search():
    spec = importlib.util.spec_from_file_location("run_fair_baseline_search", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_parse_scales_picks_indices_in_order_once(search):
    assert search.parse_scales(None) == list(range(len(search.SCALES)))
    assert search.parse_scales("3") == [3]
    assert search.parse_scales("2, 0,2") == [2, 0]
    assert search.parse_scales("1", num=2) == [1]


@pytest.mark.parametrize("text", ["", "99", "-1", "a", "1,,2"])
def test_parse_scales_rejects_what_is_not_an_index(search, text):
    with pytest.raises(ValueError, match="--scales"):
        search.parse_scales(text)
    with pytest.raises(ValueError, match="--scales"):
        search.parse_scales(str(len(search.SCALES)))  # one past the last index


def _tasks(seed: int, n: int = 200) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.005, 0.015, n)


def test_compare_strictly_better_is_fair_and_beats(search):
    plugin = _tasks(0)
    off = 0.7 * plugin * np.random.default_rng(1).uniform(0.95, 1.05, plugin.size)
    res = search.compare(off, plugin)
    assert res["excess_ci"][1] < 0 and res["fair"] and res["beats"]
    assert res["units"] == plugin.size


def test_compare_level_is_fair_but_does_not_beat(search):
    plugin = _tasks(0)
    off = plugin * np.random.default_rng(2).uniform(0.95, 1.05, plugin.size)
    res = search.compare(off, plugin)
    assert res["excess_ci"][0] < 0 < res["excess_ci"][1] < res["margin"]
    assert res["fair"] and not res["beats"]


def test_compare_worse_or_undecided_is_neither(search):
    plugin = _tasks(0)
    worse = search.compare(1.3 * plugin, plugin)
    assert not worse["fair"] and not worse["beats"]
    # level on average but too few, too noisy tasks: the interval reaches above the margin
    few = np.array([0.01, 0.002, 0.02, 0.005])
    undecided = search.compare(few[::-1].copy(), few)
    assert undecided["excess_ci"][1] > undecided["margin"]
    assert not undecided["fair"] and not undecided["beats"]


TINY = (8, 1, 12, 2, 4, 1e-3)


def test_main_rows_sizes_skip_and_checkpoint_reuse(search, tmp_path, monkeypatch):
    monkeypatch.setattr(search, "SCALES", (TINY,))
    out, ckpt = tmp_path / "search.jsonl", tmp_path / "ckpt"
    base = ["--out", str(out), "--checkpoints", str(ckpt), "--eval-batch", "2"]
    args = [*base, "--tasks", "3", "--points", "8"]
    assert search.main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert row["scale"] == list(TINY) and row["eval_tasks"] == 3 and row["eval_points"] == 8
    assert len(row["off_tasks"]) == len(row["plugin_tasks"]) == 3
    assert row["train_cpu_s"] > 0 and row["eval_cpu_off_s"] > 0 and row["eval_cpu_plugin_s"] > 0
    assert set(row["fair"]) >= {"fair", "beats", "excess", "excess_ci", "units"} and row["fair"]["units"] == 3
    assert row["plateau"]["converged"] is False  # 12 steps: too few to tell
    assert json.loads((ckpt / search.scale_name(TINY) / "train_cpu.json").read_text())["train_cpu_s"] > 0
    # the plug-in is scored on the held-out tasks of the test split, same noise: recompute it
    tasks = search.eval_tasks(3, 8)
    assert tuple(tasks.target.shape) == (3, 8, 2) and tuple(tasks.support.shape) == (3, search.NUM_SUPPORT, 2)
    cfg = EvalConfig(num_generated=8, grid_points=100, sigma_min=search.SIGMA_MIN, seed=0, batch_tasks=2)
    plug = evaluate_methods({"p": lambda s, mk: plugin_field(s, mk, sigma_min=search.SIGMA_MIN)}, tasks, cfg)
    np.testing.assert_allclose(row["plugin_tasks"], plug["p"]["mmd2_median"], rtol=1e-12)
    # a rerun with the same sizes adds nothing
    assert search.main(args) == 0
    assert len(out.read_text().splitlines()) == 1
    # other sizes add a row; the finished model is reloaded, its training CPU read back
    assert search.main([*base, "--tasks", "4", "--points", "10"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["eval_tasks"], r["eval_points"]) for r in rows] == [(3, 8), (4, 10)]
    assert rows[1]["train_cpu_s"] == rows[0]["train_cpu_s"]
    assert len(rows[1]["off_tasks"]) == 4


def test_main_rejects_too_small_evaluation(search, tmp_path):
    with pytest.raises(SystemExit):
        search.main(["--out", str(tmp_path / "x.jsonl"), "--tasks", "1"])
    with pytest.raises(SystemExit):
        search.main(["--out", str(tmp_path / "x.jsonl"), "--scales", "99"])
    assert not (tmp_path / "x.jsonl").exists()
