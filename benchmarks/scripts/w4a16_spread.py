"""The W4A16 decode kernel spread over a few CTAs per SM, against the shipped one CTA per 32-column block.

At one token an SM of the H200 streams about its share of HBM (w4a16_blocks_per_sm.py), and a grid of
one CTA per block takes as long as the SMs that hold the most blocks: 11008 x 4096 (344 blocks) puts 3
on 80 SMs and 2 on 52, Llama-2-7B's gate/up launch (688) 6 on 28 and 5 on the rest. The spread kernel
(w4a16_spread.cu, appended to csrc/w4a16_mma.cu) cuts the groups of all blocks, block after block, into
equal ranges, one a CTA, a few CTAs per SM, and each CTA's range into equal ranges of whole groups, one
a warp (one or two segments, each the shipped pipeline); the two CTAs that share a block meet through
one 64-bit atomic swap per output (value and flag together, no fence, no waiting).

For each launch (single weights, and Llama-2-7B's and Llama-3-8B's q/k/v and gate/up) and token count:
the shipped kernel at the op's config, and spread grids (CTAs per SM x warps); CUDA graphs, weights
rotated past the L2, rounds alternating between them, medians. Every output is checked against the
fp32 reference, every spread output against a second call bit for bit, and the exchange slots must be
zero again after the timing.

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_spread.py --build-only .exp/spread   # nvcc, no GPU
    PYTHONPATH=. python3 benchmarks/scripts/w4a16_spread.py --prebuilt .exp/spread --json out.json

H200 (results/w4a16-spread-h200.json/.log): slower on every launch, 3-15% at its best grid (notes-w4a16.md, session 35).
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import GROUP, TIMING, int4_bytes, random_int4  # noqa: E402
from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.kernels import cuda_build, launch, w4a16  # noqa: E402
from nibble.kernels.early_launch import early_launch  # noqa: E402
from nibble.kernels.reference import w4a16_matmul  # noqa: E402

APPENDED = Path(__file__).with_suffix(".cu")
# A warp runs one or two pipelines, so run_pipeline's closing CTA barrier moves out of it, into the
# shipped kernel (whose SASS is then the shipped one's) and after the spread kernel's last segment.
EDITS = [("  run_pipeline<RING, AHEAD>(s_begin, s_end, issue, step, [&] { xstream.advance(RING); });\n\n  float* partial",
          "  run_pipeline<RING, AHEAD>(s_begin, s_end, issue, step, [&] { xstream.advance(RING); });\n"
          "  __syncthreads();\n\n  float* partial")]
HEADER_EDITS = {"skinny.cuh": [("  cp_async_wait<0>();\n  __syncthreads();\n}", "  cp_async_wait<0>();\n}")]}
SIGNATURES = cuda_build.signatures(
    "nibble_w4a16_mma_spread", [ctypes.c_int] * 3 + [ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_void_p] * 6
    + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p], "nibble_cuda_error_string")
# (name, widths of the launch's weights, K)
LAUNCHES = [
    ("11008x4096", (11008,), 4096), ("14336x4096", (14336,), 4096), ("12288x4096", (12288,), 4096),
    ("4096x4096", (4096,), 4096), ("28672x8192", (28672,), 8192), ("8192x28672", (8192,), 28672),
    ("llama2-7b q/k/v", (4096, 4096, 4096), 4096), ("llama2-7b gate/up", (11008, 11008), 4096),
    ("llama3-8b q/k/v", (4096, 1024, 1024), 4096), ("llama3-8b gate/up", (14336, 14336), 4096),
]
SPREADS = ((1, 16), (2, 8), (2, 12), (2, 16), (3, 8), (4, 8))  # (CTAs per SM, warps)


def build(out_dir: Path) -> ctypes.CDLL:
    return cuda_build.build_edited("w4a16_mma", EDITS, out_dir, arch="90", append=APPENDED.read_text(),
                                   header_edits=HEADER_EDITS)


def spread_grid(blocks: int, K: int, per_sm: int, warps: int, sms: int) -> int:
    """The spread kernel's grid, or 0 where it cannot spread (w4a16_spread.cu: no CTA range shorter than
    a block, no warp range longer than one)."""
    ctas, units = min(blocks, per_sm * sms), K // GROUP
    return ctas if launch.cdiv(launch.cdiv(blocks * units, ctas), warps) <= units else 0


def spread_call(lib, x, weights, cfg, ctas):
    M, K = x.shape
    ns = [qw.shape[1] for qw, _, _ in weights]
    outs = [torch.empty((M, n), dtype=x.dtype, device=x.device) for n in ns]
    slots = launch.split_counters(x.device, 2 * 256 * ctas)  # zero between calls: the kernel resets them
    pointers = [cuda_build.c_array(ctypes.c_void_p, [t.data_ptr() for t in ts]) for ts in (*zip(*weights), outs)]
    err = lib.nibble_w4a16_mma_spread(
        int(x.dtype == torch.bfloat16), cfg.warps, int(cfg.x_l1), x.data_ptr(), M, K, w4a16._group_shift_steps(GROUP, K),
        x.stride(0), len(weights), *pointers, cuda_build.c_array(ctypes.c_int, ns),
        cuda_build.c_array(ctypes.c_int, [o.stride(0) for o in outs]), ctas, slots.data_ptr(),
        int(early_launch(x.device, M)), cfg.successor, torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"spread launch failed: {lib.nibble_cuda_error_string(err).decode()}")
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--build-only", type=Path, help="build the variant into this folder and exit (nvcc, no GPU)")
    ap.add_argument("--prebuilt", type=Path, help="a folder --build-only filled")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.build_only:
        build(args.build_only)
        return
    dev = torch.device("cuda")
    sms = launch.num_sms(dev)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        lib = (ctypes.CDLL(str((args.prebuilt / "w4a16_mma_edited.so").resolve())) if args.prebuilt
               else build(Path(tmp)))
        SIGNATURES(lib)
        for name, widths, K in LAUNCHES:
            sets = [[random_int4(n, K, GROUP, dev) for n in widths]
                    for _ in range(rotations(int4_bytes(sum(widths), K, GROUP)))]
            for M in (int(m) for m in args.ms.split(",")):
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                pick = w4a16.select_mma_config(M, sum(widths), K, sms)
                arms = {"shipped": lambda ws, cfg=pick: w4a16.w4a16_mma_many(x, ws, GROUP, config=cfg)}
                for per_sm, warps in SPREADS:
                    ctas = spread_grid(sum(widths) // 32, K, per_sm, warps, sms)
                    if ctas:
                        cfg = dataclasses.replace(pick, warps=warps)
                        arms[f"spread{per_sm}x{warps}"] = lambda ws, cfg=cfg, ctas=ctas: spread_call(lib, x, ws, cfg, ctas)
                ref = [w4a16_matmul(x.float(), *w, GROUP) for w in sets[0]]
                for label, arm in arms.items():  # correct, and the same bits call after call
                    outs, again = arm(sets[0]), arm(sets[0])
                    for o, a, r in zip(outs, again, ref):
                        err = (o.float() - r).abs().max().item() / r.abs().max().item()
                        assert err < 2e-2, (name, M, label, err)
                        assert torch.equal(o, a), (name, M, label, "not repeatable")
                times = {label: [] for label in arms}
                for _ in range(args.rounds):
                    for label, arm in arms.items():
                        times[label].append(bench_us(lambda i, arm=arm: (lambda: arm(sets[i])), len(sets), **TIMING))
                assert not launch.split_counters(dev, 1).any(), "exchange slots left nonzero"
                med = {label: statistics.median(t) for label, t in times.items()}
                best = min((label for label in med if label != "shipped"), key=med.get)
                row = dict(launch=name, widths=list(widths), K=K, M=M, config=str(pick), us=med, best_spread=best,
                           shipped_over_best=med["shipped"] / med[best])
                rows.append(row)
                print(f"{name:18s} M={M}: shipped {med['shipped']:6.2f} us  " + "  ".join(
                    f"{label} {t:6.2f}" for label, t in med.items() if label != "shipped")
                    + f"  best {best}: {row['shipped_over_best']:.3f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(spreads=SPREADS), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
