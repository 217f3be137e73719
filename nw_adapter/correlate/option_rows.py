"""The rows of ``correlate.py``'s two tables (:mod:`~nw_adapter.correlate.option_table`): a
:class:`Run`, an :class:`Option`, the :class:`Record` entries an option writes into the options
record, and :class:`Resolved`, what a run resolved that those entries read. Standard library only.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "COMPARE_SWAP",
    "END_TO_END",
    "OMIT",
    "REPLOT",
    "RHO",
    "SUPPORT_SETS",
    "Needs",
    "Option",
    "Record",
    "Resolved",
    "Run",
]

# --- the options record ----------------------------------------------------------------------

OMIT = object()
"""A :class:`Record` value that leaves its entry out of the record."""


@dataclass
class Resolved:
    """What a run resolved before it records its options (filled by the shared model loader).

    Attributes:
        model: The model as recorded (:func:`nw_adapter.correlate.families.shown_spec`, as a dict).
        resolved_model: The resolved spec (files and folders), fingerprinted only.
        device: The device the run computes on.
        dtype: The torch dtype's name (``float32``).
        call: The pipeline call's family arguments (Flux: ``true_cfg_scale``, ``max_sequence_length``).
        scheduler_class: The pipeline's scheduler class, once loaded.
        labels: compare-swap: where the references' classes come from.
        judge: The class judge, or None.
    """

    model: dict | None = None
    resolved_model: dict | None = None
    device: str | None = None
    dtype: str | None = None
    call: dict = field(default_factory=dict)
    scheduler_class: str | None = None
    labels: str | None = None
    judge: str | None = None


ValueOf = Callable[[argparse.Namespace, Resolved], Any]


@dataclass(frozen=True)
class Record:
    """One entry of the options record.

    Attributes:
        key: Its key in the record (``config`` of the run's result file).
        runs: The runs whose record holds it.
        value: ``value(args, resolved)``, or :data:`OMIT`; None: the option's own value.
        fingerprinted: The runs whose fingerprint it enters (None: all of ``runs``; only runs that
            resume have a fingerprint).
        omit_default: Leave the entry out while the option has its default value (an option added
            later: the fingerprints of earlier runs stay valid).
    """

    key: str
    runs: frozenset[str]
    value: ValueOf | None = None
    fingerprinted: frozenset[str] | None = None
    omit_default: bool = False


# --- the runs ------------------------------------------------------------------------------------

RHO = "rho"
END_TO_END = "end-to-end"
COMPARE_SWAP = "compare-swap"
SUPPORT_SETS = "support-sets"
REPLOT = "replot"


@dataclass(frozen=True)
class Run:
    """One kind of job of the command line.

    Attributes:
        name: The run's name in the option table.
        title: The run in messages (``the compare-swap run (--compare-swap)``).
        selectors: The options (destinations) that choose it; none for the default run.
        module: The module whose ``run(args) -> int`` does it.
        inputs: Options of which at least one must be given, and ``no_input``, the error otherwise.
        family_limit: The field of the family registry's row
            (:class:`~nw_adapter.integration.families.Family`) that says why the run cannot run on
            that family (its text refuses the family; None there: it runs); empty: it runs on every
            family, or loads no model.
        family_fix: The fix that ends a family's refusal.
        one_process: Why it runs in one process (refused under ``accelerate launch``), or None
            when it splits its work over the processes.
        resumes: Whether finished work is matched by :func:`fingerprint` and reused.
        kept: What an interruption or a failed write keeps, and the fix (ends the one line).
        writes: Its files in ``--out`` (for the docs).
        records: Entries of its options record that no option sets.
    """

    name: str
    title: str
    selectors: tuple[str, ...]
    module: str
    inputs: tuple[str, ...] = ()
    no_input: str = ""
    family_limit: str = ""
    family_fix: str = ""
    one_process: str | None = None
    resumes: bool = False
    kept: str = ""
    writes: str = ""
    records: tuple[Record, ...] = ()


@dataclass(frozen=True)
class Needs:
    """An option read only while another option's value passes ``holds`` (refused with ``message`` else).

    Attributes:
        dest: The other option.
        holds: Its value, or a test of its value.
        message: The one line of the refusal, with the fix.
        shown: The condition in words (docs/cli.md's option table): ``"with the control on"``.
    """

    dest: str
    holds: Any
    message: str
    shown: str

    def met(self, args: argparse.Namespace) -> bool:
        """Whether the condition holds for the parsed options."""
        value = getattr(args, self.dest)
        return bool(self.holds(value)) if callable(self.holds) else value == self.holds


@dataclass(frozen=True)
class Option:
    """One command-line option.

    Attributes:
        flags: Its flags (``("-q", "--quiet")``); the last one names it in messages.
        group: The ``--help`` group.
        help: The help text (``%(prog)s`` is the command).
        runs: The runs that read it; given to any other, it is refused.
        parse: Its value parser (:mod:`~nw_adapter.correlate.option_values`), or None for text.
        default: Its default.
        action: ``argparse`` action (``store_true``, ``append``, ...), or None to store a value.
        choices: Allowed values.
        metavar: The value's name in ``--help``.
        dest: The attribute name (default: from the long flag).
        records: What it writes into the options record.
        needs: A condition on another option (:class:`Needs`), or a tuple of them (all must hold).
        families: The model families that read it (None: every family), and ``family_fix``, the
            fix when given for another one.
        hints: ``{run: fix}``: the fix when the option is refused by that run (default: drop it).
    """

    flags: tuple[str, ...]
    group: str
    help: str
    runs: frozenset[str]
    parse: Callable[[str], Any] | None = None
    default: Any = None
    action: Any = None
    choices: Sequence[str] | None = None
    metavar: str | None = None
    dest_name: str | None = None
    records: tuple[Record, ...] = ()
    needs: Needs | tuple[Needs, ...] | None = None
    families: frozenset[str] | None = None
    family_fix: str = ""
    hints: Mapping[str, str] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        """The ``argparse`` destination (as ``argparse`` derives it from the first long flag)."""
        if self.dest_name:
            return self.dest_name
        long = next(flag for flag in self.flags if flag.startswith("--"))
        return long[2:].replace("-", "_")

    @property
    def conditions(self) -> tuple[Needs, ...]:
        """Its conditions on other options (:attr:`needs` as a tuple), checked in this order."""
        if self.needs is None:
            return ()
        return self.needs if isinstance(self.needs, tuple) else (self.needs,)

    @property
    def name(self) -> str:
        """The flag that names it in messages."""
        return self.flags[-1]

    def argparse_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``add_argument``."""
        kwargs: dict[str, Any] = {"help": self.help}
        if self.action is not None:
            kwargs["action"] = self.action
        kwargs["default"] = self.default
        for key, value in (("type", self.parse), ("choices", self.choices), ("metavar", self.metavar)):
            if value is not None:
                kwargs[key] = value
        if self.dest_name:
            kwargs["dest"] = self.dest_name
        return kwargs
