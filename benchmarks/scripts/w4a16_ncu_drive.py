"""Runs the W4A16 op three times at M = 1, 8 and 16 on one layer, for Nsight Compute to profile the
skinny kernel's launches (results/w4a16-mma-ncu-m1-m8-m16-h200.txt):

    NIBBLE_CACHE_DIR=... PYTHONPATH=. ncu --clock-control none --kernel-name regex:w4a16_mma_kernel -c 9 \
        --section LaunchStats --section Occupancy --section SchedulerStats --section SpeedOfLight \
        --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        python3 benchmarks/scripts/w4a16_ncu_drive.py 12288 4096
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import GROUP, random_int4  # noqa: E402
from nibble.kernels import launch  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("N", type=int, help="the layer's output features")
    ap.add_argument("K", type=int, help="the layer's input features")
    args = ap.parse_args()
    N, K = args.N, args.K
    dev = torch.device("cuda")
    w = random_int4(N, K, GROUP, dev)
    for M in (1, 8, 16):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            torch.ops.nibble.w4a16_linear(x, *w, GROUP)
        torch.cuda.synchronize()
        print(M, W.select_mma_config(M, N, K, launch.num_sms(dev)), flush=True)


if __name__ == "__main__":
    main()
