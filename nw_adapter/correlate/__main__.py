"""``python -m nw_adapter.correlate ...``: the correlate command line (:func:`.cli.main`)."""

from __future__ import annotations

import sys

from nw_adapter.correlate.cli import main

if __name__ == "__main__":
    sys.exit(main())
