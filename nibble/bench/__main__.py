"""``python -m nibble.bench <suite> [options]``; suites: ``kernels`` (W4A16), ``w4a4`` (W4A4)."""
from __future__ import annotations

import importlib
import sys

SUITES = {"kernels": "nibble.bench.kernels", "w4a4": "nibble.bench.w4a4"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m nibble.bench {kernels,w4a4} [options]\n"
              "  kernels: W4A16 against cuBLAS and tinygemm; w4a4: W4A4 against cuBLAS bf16 / INT8 / FP8\n"
              "  python -m nibble.bench SUITE --help: the suite's options (--quick, --out, --rounds, ...)")
        return 0 if argv else 2
    suite, rest = argv[0], argv[1:]
    if suite not in SUITES:
        print(f"unknown benchmark suite {suite!r}; available: {', '.join(SUITES)}", file=sys.stderr)
        return 2
    return importlib.import_module(SUITES[suite]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
