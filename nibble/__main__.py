"""``python -m nibble``: the `nibble` command (nibble/cli.py), where the console script is not on PATH."""
from __future__ import annotations

import sys

from nibble.cli import main

if __name__ == "__main__":
    sys.exit(main())
