"""One mechanism keeps diffusers' and transformers' output off the terminal, for the command line
(``correlate.console``), its model loading (``correlate.loading``) and the notebook loaders
(``models.loaders.quiet_loading``). What each prints is tested where it shows: a fresh notebook
load prints nothing (``tests/models/test_loaders.py``), the command line's output holds no library
line (``tests/correlate/test_cli_e2e.py``)."""

from __future__ import annotations

import argparse
import warnings

import pytest
from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as transformers_logging

from nw_adapter.library_output import CRITICAL, ERROR, library_output, quiet_library_environment

LOGGERS = (diffusers_logging, transformers_logging)
INFO = 20


def state() -> list[tuple[int, bool]]:
    return [(log.get_verbosity(), log.is_progress_bar_enabled()) for log in LOGGERS]


@pytest.fixture
def loud():
    """Both libraries at INFO with their bars on (a notebook after ``set_verbosity_info()``), every
    warning shown (the suite's own filters hide FutureWarning), restored afterwards."""
    before = state()
    for log in LOGGERS:
        log.set_verbosity(INFO)
        log.enable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        yield
    for log, (level, bars) in zip(LOGGERS, before, strict=True):
        log.set_verbosity(level)
        (log.enable_progress_bar if bars else log.disable_progress_bar)()


def future_warnings() -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("a library's deprecation", FutureWarning, stacklevel=1)
    return len(caught)


@pytest.mark.parametrize(
    ("choice", "inside"),
    [
        ({}, [(ERROR, False)] * 2),
        ({"bars": True}, [(ERROR, True)] * 2),
        ({"verbose": True}, [(INFO, False)] * 2),
        ({"verbose": True, "bars": True}, [(INFO, True)] * 2),
        ({"level": CRITICAL}, [(CRITICAL, False)] * 2),
    ],
)
def test_the_block_sets_what_is_asked_and_restores_it(loud, choice, inside) -> None:
    with library_output(**choice):
        assert state() == inside
        hidden = future_warnings() == 0
    assert hidden == (not choice.get("verbose"))  # the libraries' deprecations: only when not verbose
    assert state() == [(INFO, True)] * 2 and future_warnings() == 1


def test_the_state_is_restored_after_an_exception(loud) -> None:
    with pytest.raises(KeyError), library_output():
        raise KeyError("a load that failed")
    assert state() == [(INFO, True)] * 2


def test_the_command_line_and_the_notebook_loaders_use_it(loud) -> None:
    """The command line's block without ``-v`` (``-q``: no bars) and the loaders' quiet
    load set the same state; with ``-v`` / ``verbose=True`` they leave the loggers as they are."""
    from nw_adapter.correlate.console import library_output as cli_output
    from nw_adapter.correlate.loading import _quiet_loading
    from nw_adapter.models.loaders import quiet_loading

    seen = {}
    for name, block in (
        ("cli", cli_output(argparse.Namespace(verbose=False, quiet=1))),
        ("notebook", quiet_loading()),
        ("cli -v", cli_output(argparse.Namespace(verbose=True, quiet=1))),
        ("notebook verbose", quiet_loading(verbose=True)),
        ("cli loading", _quiet_loading(False)),
    ):
        with block:
            seen[name] = state()
    assert seen["cli"] == seen["notebook"] == [(ERROR, False)] * 2
    assert seen["cli -v"] == [(INFO, False)] * 2  # -v: the libraries' words; bars only on a terminal
    assert seen["notebook verbose"] == [(INFO, True)] * 2
    assert seen["cli loading"] == [(CRITICAL, True)] * 2  # a load error becomes the one line, alone
    assert state() == [(INFO, True)] * 2


def test_the_environment_follows_the_same_choice_and_keeps_the_users(monkeypatch) -> None:
    import os

    names = ("TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")
    for name in (*names, "HF_HUB_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    monkeypatch.setenv("DIFFUSERS_VERBOSITY", "info")  # the user's choice
    quiet_library_environment(verbose=True, bars=True)
    assert [os.environ.get(n) for n in names] == [None, "info", None]
    quiet_library_environment()
    assert [os.environ.get(n) for n in names] == ["error", "info", "1"]
