"""Merge the report.json of runs that measured different configs (one device call per config when a
single call would not fit the device's time limit) into one report folder: configs and speed models
united (``nibble.eval.report.merge_reports``), the summary, Markdown and plots rebuilt.

    python3 benchmarks/scripts/merge_reports.py --out benchmarks/results/report-smollm2-h200 \\
        bf16/report.json w4a16/report.json w4a4/report.json w4a4-hadamard/report.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.eval.report import merge_reports, read_json, write_json, write_markdown, write_plots  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for report.md, report.json and the PNGs")
    ap.add_argument("reports", nargs="+", help="report.json files, in the order their configs should appear")
    args = ap.parse_args()
    merged = merge_reports([read_json(p) for p in args.reports])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(merged, out / "report.json")
    write_markdown(merged, out / "report.md")
    write_plots(merged, out)
    print(f"wrote {out}: configs {merged['meta']['configs']}")


if __name__ == "__main__":
    main()
