"""Where a persistent W4A4 wgmma CTA's time goes, item by item: the shipped kernel
(csrc/w4a4_wgmma.cu) rebuilt with %globaltimer stamps (consumer thread 0 of each CTA, first 8
items), run once per shape after a CUDA-graph timing of the same call.

    PYTHONPATH=. python3 benchmarks/scripts/w4a4_item_timeline.py      (H100/H200 and nvcc)

Per item, medians over the CTAs, microseconds: wait for its first stage (the pipeline ramp),
mainloop (first stage landed -> last MMA done), epilogue (scales, float math, stores); the
instrumented copy lives in a temporary folder, the package is not touched.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import bench_us, rotations  # noqa: E402
from nibble.bench.w4a4 import random_w4a4  # noqa: E402
from nibble.kernels import cuda_build  # noqa: E402
from nibble.kernels import w4a4 as W  # noqa: E402

STAMPS = 8  # per item: 0 item start, 1 first stage landed, 2 MMAs done, 3 scales staged, 4 stores done
# (text in the shipped kernel -> the same text with a stamp); each must occur exactly once
EDITS = [
    ("namespace {\n", "__device__ unsigned long long g_t[132 * 64];\n#define STAMP(item, idx) if (tid == 0 && (item) < 8) "
     "{ unsigned long long t_; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t_)); "
     "g_t[blockIdx.x * 64 + (item) * 8 + (idx)] = t_; }\nnamespace {\n"),
    ("  for (int w = blockIdx.x, first = 0; w < items; w += gridDim.x) {\n"
     "    const int tile = SPLIT ? w / splits : w, split = SPLIT ? w % splits : 0;",
     "  for (int w = blockIdx.x, first = 0, item = 0; w < items; w += gridDim.x, ++item) {\n"
     "    const int tile = SPLIT ? w / splits : w, split = SPLIT ? w % splits : 0;\n    STAMP(item, 0)"),
    # (the first stage has landed at the first iteration: waited for there, or before the loop
    # where the words are read a step ahead)
    ("      if (!AHEAD) mbar_wait(bars + 8 * s, ((first + i) / STAGES) & 1);\n",
     "      if (!AHEAD) mbar_wait(bars + 8 * s, ((first + i) / STAGES) & 1);\n      if (i == 0) STAMP(item, 1)\n"),
    ("    for (int j = 0; j < J; ++j) fence_operands(acc[j]);\n    // The item's last stage",
     "    for (int j = 0; j < J; ++j) fence_operands(acc[j]);\n    STAMP(item, 2)\n    // The item's last stage"),
    ("    if (wg_tid < BN) token_scale[wg_tid] = my_scale;\n    asm volatile(\"bar.sync %0, 128;\" ::\"r\"(2 + wg) : \"memory\");\n",
     "    if (wg_tid < BN) token_scale[wg_tid] = my_scale;\n    asm volatile(\"bar.sync %0, 128;\" ::\"r\"(2 + wg) : \"memory\");\n"
     "    STAMP(item, 3)\n"),
    ("          }\n        }\n      }\n    }\n  }\n}", "          }\n        }\n      }\n    }\n    STAMP(item, 4)\n  }\n}"),
]
READ = ('\nextern "C" int nibble_read_times(void* h) { return (int)cudaMemcpyFromSymbol(h, g_t, sizeof(g_t)); }\n'
        'extern "C" int nibble_zero_times() { static unsigned long long z[132 * 64]; '
        'return (int)cudaMemcpyToSymbol(g_t, z, sizeof(z)); }\n')
SHAPES = [(128, 12288, 4096, (128, 128)), (128, 4096, 4096, (128, 128)), (512, 12288, 4096, (128, 128)),
          (1024, 12288, 4096, (128, 256)), (1024, 12288, 4096, (128, 128))]


def build(tmp: Path) -> ctypes.CDLL:
    lib = cuda_build.build_edited("w4a4_wgmma", EDITS, tmp, append=READ)
    W.WGMMA.signatures(lib)
    lib.nibble_read_times.argtypes = [ctypes.c_void_p]
    return lib


def timeline(lib, M, N, K, tile) -> None:
    cfg = dict(bn=tile[0], channels=tile[1], split_k=1)
    ws = [random_w4a4(N, K, "cuda") for _ in range(rotations(N * K // 2))]
    qx, sx = W.quantize_activations_triton(torch.randn(M, K, device="cuda", dtype=torch.bfloat16), False, "even_odd")
    call = lambda i: (lambda: W.w4a4_wgmma(qx, sx, ws[i][0], ws[i][1], None, torch.bfloat16,  # noqa: E731
                                           order="even_odd", config=cfg))
    us = bench_us(call, len(ws))
    lib.nibble_zero_times()
    call(1 % len(ws))()
    torch.cuda.synchronize()
    buf = np.zeros(132 * 64, dtype=np.uint64)
    lib.nibble_read_times(buf.ctypes.data)
    t = buf.reshape(132, 8, STAMPS).astype(np.int64)
    ctas = [b for b in range(132) if t[b, 0, 4] > 0]
    t0 = min(t[b, 0, 0] for b in ctas)
    print(f"M={M} {N}x{K} tile {tile[0]}x{tile[1]}: {us:.1f} us (graph), {len(ctas)} CTAs")
    for i in range(8):
        bs = [b for b in ctas if t[b, i, 4] > 0]
        if not bs:
            break

        def med(a, b):
            return statistics.median(t[c, i, b] - t[c, i, a] for c in bs) / 1000
        print(f"  item {i} ({len(bs):3d} CTAs): starts {statistics.median(t[c, i, 0] - t0 for c in bs) / 1000:6.2f}"
              f"  first stage {med(0, 1):5.2f}  mainloop {med(1, 2):6.2f}  scales {med(2, 3):5.2f}"
              f"  epilogue {med(3, 4):5.2f}")


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not (torch.cuda.is_available() and W.wgmma_applicable(32, 32, 32, "cuda")):
        print("needs an sm_90 GPU and nvcc")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
        W.WGMMA.lib = lambda device, lib=lib: lib
        for M, N, K, tile in SHAPES:
            timeline(lib, M, N, K, tile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
