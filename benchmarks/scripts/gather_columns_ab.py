"""The act-order gather (`nibble.kernels.gather_columns`, x[..., perm]): its two kernels at every size.

The column-block kernel runs a program per (row, 1,024 columns), each loading its 1,024 entries of the
row at random places: every program of a row touches most of the row's sectors, so at prefill a row
crosses the L2 once per program. The row kernel loads each row once, coalesced, and permutes it inside
the program (`tl.gather`); the op takes it above 64 rows (session 53, where this script first timed it
against the column kernel as the op then was: results/session53-h200/gather-columns-ab.json). Times the
op, the row kernel at 4 / 8 / 16 warps and PyTorch's index_select, CUDA graphs, 3 interleaved rounds,
median; every output checked against index_select first (H200).

    PYTHONPATH=. python3 benchmarks/scripts/gather_columns_ab.py --json $OUT/gather-columns-ab.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import env_meta, time_against  # noqa: E402
from nibble.kernels import w4a16  # noqa: E402


def gather_rows(x: torch.Tensor, index: torch.Tensor, warps: int) -> torch.Tensor:
    """The whole-row kernel at any row count and ``warps`` (the op takes it above 64 rows, at 8 warps)."""
    out = torch.empty_like(x)
    w4a16._gather_rows_kernel[(x.shape[0],)](x, index, out, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]),
                                             num_warps=warps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,8,128,512,2048")
    ap.add_argument("--ks", default="4096,8192,11008,14336")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for K in (int(k) for k in args.ks.split(",")):
        index = torch.randperm(K, device="cuda")
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            want = x.index_select(1, index)
            arms = {"shipped": lambda: w4a16.gather_columns(x, index), "index_select": lambda: x.index_select(1, index)}
            for warps in (4, 8, 16):
                arms[f"row_w{warps}"] = lambda warps=warps: gather_rows(x, index, warps)
            for name, fn in arms.items():
                assert torch.equal(fn(), want), (name, M, K)
            rows += time_against(arms, "shipped", args.rounds, M=M, K=K)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
