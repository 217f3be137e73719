"""The integration layer's exceptions (no torch import: the command line catches them cheaply).

Both are ``ValueError`` subclasses, so code that caught ``ValueError`` keeps working; callers that
must tell them apart (the command line's exit status 2) catch the type, never match message text.
"""

from __future__ import annotations


class NWConfigError(ValueError):
    """An invalid NW option: the message names the option, the problem and the fix."""


class NWInstallError(ValueError):
    """The NW processors cannot be installed on this pipeline (no denoiser with attention
    processors, no IP-Adapter loaded, xFormers processors); the message says what to do."""
