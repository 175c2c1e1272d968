"""A TMA-fed skinny W4A16 kernel (w4a16_tma_stream.cu beside this script, appended to
csrc/w4a16_mma.cu) against the shipped cp.async one: outputs checked against the fp32 reference
(poisoned first), then both timed as ``python -m nibble.bench kernels`` times (CUDA graphs, weights
rotated past the L2, median). ``copy`` is the same kernel with consumers that only wait for each
chunk and release it: what the copies alone cost.

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_tma_stream.py --build .exp/tma      # nvcc only
    PYTHONPATH=. python3 benchmarks/scripts/w4a16_tma_stream.py --libs .exp/tma --json $OUT/tma.json

Results (H200, session 19): benchmarks/results/w4a16-tma-stream-ctawide-h200.json and -m16-h200.json,
measured with the form of commit 75afc85 (the same arithmetic written out; this form shares the
shipped kernel's step_mmas / GroupFold, and ptxas schedules it a little differently). ``self`` /
``self_copy`` (session 20, NIBBLE_TMA_SELF_FED): no producer warp, every warp copies its own chunks
into its own stages (``--variants self:16x8x16,...``, up to 16 warps):
benchmarks/results/w4a16-tma-stream-self-fed-h200.json, 0.72-0.81x the shipped kernel.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import random_int4  # noqa: E402
from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.kernels import cuda_build  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402

TIMING = dict(warmup_ms=10, reps=20)
SINGLE = [(4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336),
          (28672, 8192), (8192, 28672)]
GROUPED = {"llama2 qkv": ([4096] * 3, 4096), "llama2 gate/up": ([11008] * 2, 4096),
           "llama3 qkv": ([4096, 1024, 1024], 4096), "llama3 gate/up": ([14336] * 2, 4096)}
SELF_FED = "#define NIBBLE_TMA_SELF_FED 1\n"
VARIANTS = {"full": "", "copy": "#define NIBBLE_TMA_COPY_ONLY 1\n", "self": SELF_FED,
            "self_copy": SELF_FED + "#define NIBBLE_TMA_COPY_ONLY 1\n"}
SOURCE = Path(__file__).with_name("w4a16_tma_stream.cu")
ANCHOR = '#include "skinny.cuh"\n'  # the TMA kernel needs hopper.cuh (which includes skinny.cuh)


def build(out_dir: Path, name: str) -> ctypes.CDLL:
    """csrc/w4a16_mma.cu with the TMA kernel appended (it uses the file's helpers), for sm_90."""
    return cuda_build.build_edited("w4a16_mma", [(ANCHOR, VARIANTS[name] + '#include "hopper.cuh"\n')],
                                   out_dir / name, arch="90", append="\n" + SOURCE.read_text())


# nibble_w4a16_tma's ctypes signature (and its error string's), as the package configures its launchers
CONFIGURE = cuda_build.signatures(
    "nibble_w4a16_tma", [ctypes.c_int] * 5 + [ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_void_p] * 6
    + [ctypes.c_int, ctypes.c_void_p], "nibble_cuda_error_string")


def tma_lib(lib):
    CONFIGURE(lib)
    return lib


def tma_many(lib, x, weights, G, cfg, outs):
    rows, consumers, stages = cfg
    M, K = x.shape
    ns = [qw.shape[1] for qw, _, _ in weights]
    mt = 1 if M <= 8 else 2
    ptrs = [cuda_build.c_array(ctypes.c_void_p, [t.data_ptr() for t in ts]) for ts in (*zip(*weights), outs)]
    err = lib.nibble_w4a16_tma(int(x.dtype == torch.bfloat16), mt, rows, consumers, stages, x.data_ptr(), M, K,
                               W._group_shift_steps(G, K), x.stride(0), len(weights), *ptrs,
                               cuda_build.c_array(ctypes.c_int, ns), cuda_build.c_array(ctypes.c_int, ns),
                               1, torch.cuda.current_stream().cuda_stream)
    if err:
        raise RuntimeError(lib.nibble_cuda_error_string(err).decode())
    return outs


def check(lib, log):
    dev = torch.device("cuda")
    worst = 0.0
    for (N, K) in [(4096, 4096), (1056, 576), (64, 1536), (256, 4160), (8192, 28672)]:
        for G in (32, 64, 128, K):
            if K % G:
                continue
            w = random_int4(N, K, G, dev)
            wf = W.dequantize_cuda(*w, G, dtype=torch.float32)
            for dtype in (torch.bfloat16, torch.float16):
                for M in (1, 3, 8, 11, 16):
                    x = torch.randn(M, K, device=dev, dtype=dtype)
                    ref = x.float() @ wf.t()
                    for cfg in ((16, 1, 1), (16, 3, 6), (32, 4, 4), (64, 8, 8)):
                        out = torch.full((M, N), float("nan"), device=dev, dtype=dtype)
                        log(f"check N={N} K={K} G={G} {dtype} M={M} {cfg}")
                        tma_many(lib, x, [w], G, cfg, [out])
                        torch.cuda.synchronize()
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        shipped = W.w4a16_mma(x, *w, G).float()
                        err_s = ((shipped - ref).norm() / ref.norm()).item()
                        worst = max(worst, err / max(err_s, 1e-4))
                        bad = not torch.isfinite(out).all().item() or err > 2 * err_s + 1e-3
                        if bad:
                            log(f"BAD N={N} K={K} G={G} M={M} {dtype} {cfg}: err {err:.2e} shipped {err_s:.2e}")
    # several weights, one launch
    for ns, K in GROUPED.values():
        ws = [random_int4(n, K, 128, dev) for n in ns]
        x = torch.randn(5, K, device=dev, dtype=torch.bfloat16)
        outs = [torch.full((5, n), float("nan"), device=dev, dtype=torch.bfloat16) for n in ns]
        tma_many(lib, x, ws, 128, (32, 4, 4), outs)
        for o, w in zip(outs, ws):
            ref = x.float() @ W.dequantize_cuda(*w, 128, dtype=torch.float32).t()
            err = ((o.float() - ref).norm() / ref.norm()).item()
            if not torch.isfinite(o).all() or err > 1e-2:
                log(f"BAD grouped {ns}: err {err:.2e}")
    log(f"checks done; worst error ratio against the shipped kernel {worst:.2f}")


def time_case(libs, name, ns, K, M, variants, log):
    dev = torch.device("cuda")
    n_rot = rotations(sum(ns) * K // 2)
    sets = [[random_int4(n, K, 128, dev) for n in ns] for _ in range(n_rot)]
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    outs = [torch.empty(M, n, device=dev, dtype=torch.bfloat16) for n in ns]
    row = {"case": name, "ns": ns, "K": K, "M": M}
    if len(ns) == 1:
        wb = [torch.randn(ns[0], K, device=dev, dtype=torch.bfloat16) for _ in range(rotations(ns[0] * K * 2))]
        row["bf16"] = bench_us(lambda i: (lambda: F.linear(x, wb[i])), len(wb), **TIMING)
        del wb
    row["shipped"] = bench_us(lambda i: (lambda: W.w4a16_mma_many(x, sets[i], 128, outs=outs)), n_rot, **TIMING)
    for variant, cfg in variants:
        key = "tma_{}_r{}_c{}_s{}".format(variant, *cfg)
        log(f"  timing {name} M={M} {key}")
        lib = libs[variant]
        try:
            row[key] = bench_us(lambda i: (lambda: tma_many(lib, x, sets[i], 128, cfg, outs)), n_rot, **TIMING)
        except RuntimeError as e:
            row[key] = None
            log(f"  {key}: {e}")
    best = min((k for k in row if k.startswith("tma_") and "copy" not in k and row[k]), key=lambda k: row[k])
    log(f"{name:16s} M={M:3d} " + " ".join(f"{k}={v:.2f}" for k, v in row.items() if isinstance(v, float))
        + f"  best {best} x{row['shipped'] / row[best]:.3f} shipped" + (f" x{row['bf16'] / row[best]:.2f} bf16" if "bf16" in row else ""))
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--ms", type=int, nargs="+", default=[1])
    ap.add_argument("--build", type=Path, help="compile the variants into this folder and stop")
    ap.add_argument("--libs", type=Path, help="the folder --build wrote")
    ap.add_argument("--variants", default="full:16x4x8,full:32x4x8,full:64x4x4,full:64x4x8,copy:32x4x8,copy:64x4x4")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--cases", nargs="+", default=[f"{n}x{k}" for n, k in SINGLE] + list(GROUPED))
    args = ap.parse_args()
    log = lambda s: print(s, flush=True)  # noqa: E731
    if args.build:
        with ThreadPoolExecutor(len(VARIANTS)) as pool:
            list(pool.map(lambda name: build(args.build, name), VARIANTS))
        return
    libs = {name: tma_lib(ctypes.CDLL(str(args.libs / name / "w4a16_mma_edited.so"))) for name in VARIANTS}
    if not args.no_check:
        for name in ("full", "self"):
            log(f"checking {name}")
            check(libs[name], log)
    if args.check_only:
        return
    variants = [(v.split(":")[0], tuple(int(n) for n in v.split(":")[1].split("x"))) for v in args.variants.split(",")]
    rows = []
    for M in args.ms:
        for N, K in SINGLE:
            if f"{N}x{K}" in args.cases:
                rows.append(time_case(libs, f"{N}x{K}", [N], K, M, variants, log))
                dump(args.json, rows)
        for name, (ns, K) in GROUPED.items():
            if name in args.cases:
                rows.append(time_case(libs, name, ns, K, M, variants, log))
                dump(args.json, rows)


def dump(path, rows):
    if path:
        Path(path).write_text(json.dumps({"meta": env_meta(benchmark="w4a16-tma-stream"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
