"""The interactive report of a run: one self-contained HTML file (``report.html`` in every ``--out``).

Built with plotly (figures, menus and sliders from its Python package; plotly.js embedded once per
page, so the file opens offline in any browser without a server); imported only inside functions, so
importing this package loads neither plotly nor torch.

- :func:`~nw_adapter.correlate.html_report.build.report` (``nw_adapter.report``): a report from an
  output folder, a recorder, its records or a swap comparison;
- :func:`~nw_adapter.correlate.html_report.build.write_rho_report`,
  :func:`~nw_adapter.correlate.html_report.build.write_swap_report`,
  :func:`~nw_adapter.correlate.html_report.build.write_support_report`: the command line's writers;
- :class:`~nw_adapter.correlate.html_report.document.Report`: the page (``.save(path)``, inline in
  Jupyter).

docs/report.md says what each report holds, its size and its bounds.
"""

from __future__ import annotations

from nw_adapter.correlate.html_report.build import (
    remove_report,
    report,
    write_rho_report,
    write_support_report,
    write_swap_report,
)
from nw_adapter.correlate.html_report.document import REPORT_NAME, Report

__all__ = [
    "REPORT_NAME",
    "Report",
    "remove_report",
    "report",
    "write_rho_report",
    "write_support_report",
    "write_swap_report",
]
