"""Warnings that point at the user's line: the first caller outside nibble, however deep nibble's own calls went."""
from __future__ import annotations

import os
import sys
import warnings

# as every nibble module's code names its file: from the one import path, not resolved (a symlink would differ)
_NIBBLE = os.path.dirname(__file__) + os.sep
# Wrappers between two of nibble's frames, not the user's code: the frame of a @torch.no_grad (or other
# context-manager) decorator that a nibble function wears.
_PASS_THROUGH = ("contextlib", "torch.utils._contextlib")


def warn(message: str) -> None:
    """``warnings.warn(message)`` (a UserWarning) attributed to the line that called into nibble, where a fixed
    stacklevel named a line of nibble's wherever a function was reached another way (load_quantized calls the AWQ /
    GPTQ importer, save_quantized the exporters: one frame deeper than a direct call). Python 3.12's
    ``skip_file_prefixes`` does this; nibble runs on 3.10. Called from nibble alone (the CLI), it names the frame
    that ran nibble (runpy's)."""
    frame, stacklevel = sys._getframe(1), 2  # stacklevel 2: this function's caller
    while frame is not None and _inside_nibble(frame):
        frame, stacklevel = frame.f_back, stacklevel + 1
    warnings.warn(message, stacklevel=stacklevel)


def _inside_nibble(frame) -> bool:
    return (frame.f_code.co_filename.startswith(_NIBBLE)
            or frame.f_globals.get("__name__") in _PASS_THROUGH)
