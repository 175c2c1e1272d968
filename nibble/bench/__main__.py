"""``python -m nibble.bench <suite> [options]``; suites: ``kernels`` (W4A16 kernel benchmark)."""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m nibble.bench kernels [--quick] [--out DIR]")
        return 0 if argv else 2
    suite, rest = argv[0], argv[1:]
    if suite == "kernels":
        from nibble.bench.kernels import main as run
        return run(rest)
    print(f"unknown benchmark suite {suite!r}; available: kernels", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
