"""Kernel benchmarks: ``python -m nibble.bench kernels [--quick] [--dtype float16] [--rounds R] [--out DIR]``.

W4A16 at each shape (N, K) and M: cuBLAS (``F.linear``, op "bf16" or "fp16"), PyTorch's tinygemm
(``aten._weight_int4pack_mm``, bf16 only) and nibble (``torch.ops.nibble.w4a16_linear``), bf16
activations (or fp16 with ``--dtype float16``), group 128, timed with ``nibble.bench.timing.bench_us``
(CUDA-graph replay, weights rotated over several copies so the working set is well past the L2), the
three ops in ``--rounds`` interleaved rounds (``bench_rounds``), each cell the median of its rounds.
Writes ``DIR/w4a16-<gpu>[-fp16].json`` and ``.png`` (speedup over cuBLAS vs M).
"""
from __future__ import annotations

import math
import statistics
import sys

import torch
import torch.nn.functional as F

from nibble.bench.timing import (ROUNDS, add_rounds_argument, bench_rounds, env_meta, geomean, gpu_tag,
                                 holds_big_weight, parse_bench_args, rotations, write_results)
from nibble.formats.int4 import unpack_int4

# (N, K): Llama-2-7B q/k/v/o (4096, 4096), fused qkv (12288, 4096), Llama-2-7B MLP (11008 / 4096),
# Mistral/Llama-3-8B MLP (14336 / 4096), Llama-70B MLP (28672 / 8192).
SHAPES = [(4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336),
          (28672, 8192), (8192, 28672)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
QUICK_SHAPES = [(4096, 4096), (14336, 4096), (28672, 8192)]
QUICK_MS = [1, 16, 128, 1024]
GROUP = 128
TIMING = dict(warmup_ms=10, reps=20)  # per measurement: ~10 ms warm-up, median of 20 graph replays


def random_int4(N: int, K: int, G: int, device, gen=None):
    """Canonical-format weight with random codes, positive scales, asymmetric integer zero points."""
    qweight = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device=device, generator=gen)
    scales = (torch.rand(K // G, N, device=device, generator=gen) * 0.01 + 0.002).half()
    zp = torch.randint(0, 16, (K // G, N), device=device, generator=gen).float()
    zeros = (-zp * scales.float()).half()
    return qweight, scales, zeros


def int4_bytes(N: int, K: int, G: int) -> int:
    """Bytes of an INT4 layer: packed codes plus fp16 scales and zeros."""
    return K // 8 * N * 4 + 2 * (K // G) * N * 2


def int4_sets(N: int, K: int, G: int, device) -> list:
    """Random INT4 layers (`random_int4`), enough of them past the L2 for `bench_us` to rotate through."""
    return [random_int4(N, K, G, device) for _ in range(rotations(int4_bytes(N, K, G)))]


def weight_sets(N: int, K: int, G: int, device, dtype=torch.bfloat16):
    """Copies of one random INT4 layer and of its dequantization to ``dtype``, each set past the L2
    several times over (for `bench_us` to rotate through), and the fp32 weight to check outputs against."""
    from nibble.kernels.w4a16 import dequantize_cuda
    w4 = int4_sets(N, K, G, device)
    wb = [dequantize_cuda(*w4[i % len(w4)], G, dtype=dtype) for i in range(rotations(N * K * 2))]
    return w4, wb, dequantize_cuda(*w4[0], G, dtype=torch.float32)


def tinygemm_pack(qweight, scales, zeros, group_size, inner_k_tiles: int = 8):
    """Canonical INT4 -> (packed, scale_and_zero) for ``aten._weight_int4pack_mm`` (torch >= 2.5 layout).

    tinygemm dequantizes ``(q - 8) * scale + zero``, so its zero is ``z + 8 s``.
    """
    codes = unpack_int4(qweight).t().contiguous().to(torch.int32)  # [N, K]
    w_u8 = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack(w_u8, inner_k_tiles)
    s = scales.float()
    sz = torch.stack([s, zeros.float() + 8 * s], dim=-1).to(torch.bfloat16).contiguous()  # [K/G, N, 2]
    return packed, sz


def tinygemm_mm(x, packed, sz, group_size):
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, sz)


def baseline_op(dtype) -> str:
    """The name of cuBLAS's rows for activations of ``dtype``."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def bench_shape(N: int, K: int, ms, G: int = GROUP, log=print, dtype=torch.bfloat16, rounds: int = ROUNDS):
    """Rows (op, M, N, K, us: the median of ``rounds`` interleaved rounds, us_rounds, speedup over
    cuBLAS, GB/s, TFLOP/s) of cuBLAS, tinygemm and nibble at every M of ``ms``, activations of ``dtype``
    (tinygemm takes bf16 only)."""
    import nibble.kernels.w4a16  # noqa: F401  registers torch.ops.nibble.w4a16_linear
    dev = torch.device("cuda")
    base_op = baseline_op(dtype)
    rows = []
    layer_bytes = int4_bytes(N, K, G)
    dense_bytes = N * K * 2  # cuBLAS's 16-bit weight
    w4, wb, wf = weight_sets(N, K, G, dev, dtype)  # weight copies (rotated) for each op
    n4, nb = len(w4), len(wb)
    tg = None
    if dtype == torch.bfloat16:
        try:
            tg = [tinygemm_pack(*w4[i], G) for i in range(n4)]
        except Exception as e:  # pragma: no cover - depends on torch build
            log(f"tinygemm unavailable: {type(e).__name__}: {e}")
    # same function? (relative error vs the fp32 dequant reference)
    xc = torch.randn(8, K, device=dev, dtype=dtype)
    ref = xc.float() @ wf.t()
    chk = {}
    if tg is not None:
        chk["tinygemm"] = tinygemm_mm(xc, tg[0][0], tg[0][1], G).float()
    chk["nibble"] = torch.ops.nibble.w4a16_linear(xc, *w4[0], G).float()
    log(f"N={N} K={K} check rel err vs fp32 ref: " + " ".join(
        f"{k}={((v - ref).norm() / ref.norm()).item():.2e}" for k, v in chk.items()))
    del ref
    del wf
    for M in ms:
        x = torch.randn(M, K, device=dev, dtype=dtype)
        arms = {base_op: (lambda i: (lambda: F.linear(x, wb[i])), nb)}
        if tg is not None:
            arms["tinygemm"] = (lambda i: (lambda: tinygemm_mm(x, tg[i][0], tg[i][1], G)), n4)
        arms["nibble"] = (lambda i: (lambda: torch.ops.nibble.w4a16_linear(x, w4[i][0], w4[i][1], w4[i][2], G)), n4)
        times = bench_rounds(arms, rounds, optional=("tinygemm",), log=lambda line: log(f"M={M}{line}"), **TIMING)
        res = {op: statistics.median(t) for op, t in times.items() if t}
        base = res.get(base_op)
        for op, us in res.items():
            nbytes = (dense_bytes if op == base_op else layer_bytes) + 2 * M * (K + N)
            rows.append(dict(op=op, M=M, N=N, K=K, group_size=G, us=round(us, 3),
                             us_rounds=[round(t, 3) for t in times[op]],
                             speedup=round(base / us, 4) if base else None,
                             GBps=round(nbytes / us / 1e3, 1), TFLOPs=round(2 * M * N * K / us / 1e6, 2)))
        log(f"N={N:6d} K={K:6d} M={M:5d} " + " ".join(f"{op}={us:8.2f}us" for op, us in res.items())
            + (f"  nibble x{base / res['nibble']:.2f} {base_op}" if base and "nibble" in res else "")
            + (f" x{res['tinygemm'] / res['nibble']:.2f} tinygemm" if "tinygemm" in res and "nibble" in res else ""))
    w4 = wb = tg = None  # freed before empty_cache (not del: the timed lambdas close over them)
    torch.cuda.empty_cache()
    return rows


def summarize(rows, base_op: str = "bf16"):
    """Per M: geomean speedup of nibble vs cuBLAS in x's dtype (``base_op``'s rows, named in each
    entry's ``baseline``; all shapes, and shapes with >= 64 MB of 16-bit weight) and vs tinygemm."""
    out = []
    for M in sorted({r["M"] for r in rows}):
        nib = {(r["N"], r["K"]): r for r in rows if r["op"] == "nibble" and r["M"] == M}
        bf = {(r["N"], r["K"]): r for r in rows if r["op"] == base_op and r["M"] == M}
        tg = {(r["N"], r["K"]): r for r in rows if r["op"] == "tinygemm" and r["M"] == M}
        all_sp = [bf[k]["us"] / nib[k]["us"] for k in nib if k in bf]
        big_sp = [bf[k]["us"] / nib[k]["us"] for k in nib if k in bf and holds_big_weight(*k)]
        tg_sp = [tg[k]["us"] / nib[k]["us"] for k in nib if k in tg]
        out.append(dict(M=M, baseline=base_op, geomean_vs_cublas=geomean(all_sp),
                        geomean_vs_cublas_big=geomean(big_sp), min_vs_cublas=min(all_sp) if all_sp else math.nan,
                        geomean_vs_tinygemm=geomean(tg_sp), min_vs_tinygemm=min(tg_sp) if tg_sp else math.nan))
    return out


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m nibble.bench kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 shapes x 4 M values")
    ap.add_argument("--out", default="benchmarks/results", help="output folder (JSON + PNG)")
    ap.add_argument("--name", default=None, help="file stem (default w4a16-<gpu>, w4a16-<gpu>-fp16 for fp16)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                    help="activations, and cuBLAS's weight (tinygemm runs in bf16 only)")
    add_rounds_argument(ap)
    args = parse_bench_args(ap, argv)
    if not torch.cuda.is_available():
        print("nibble.bench kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    ms = QUICK_MS if args.quick else MS
    rows = []
    dtype = getattr(torch, args.dtype)
    base_op = baseline_op(dtype)
    name = args.name or f"w4a16-{gpu_tag()}" + ("-fp16" if dtype == torch.float16 else "")
    cmd = ("python -m nibble.bench kernels" + (" --quick" if args.quick else "")
           + (" --dtype float16" if dtype == torch.float16 else "") + f" --rounds {args.rounds}")
    for N, K in shapes:
        rows += bench_shape(N, K, ms, dtype=dtype, rounds=args.rounds)
        # partial results after every shape (a run cut short still leaves its numbers)
        write_results(rows, env_meta(benchmark="w4a16", command=cmd, partial=True), args.out, name)
    summary = summarize(rows, base_op=base_op)
    print(f"\n   M  vs cuBLAS {base_op}: geo(all)  geo(>=64MB)  min(all);  geo(vs tinygemm)  min(vs tinygemm)")
    for s in summary:
        vs_tinygemm = (f"  {s['geomean_vs_tinygemm']:15.2f}x  {s['min_vs_tinygemm']:15.2f}x"
                       if not math.isnan(s["geomean_vs_tinygemm"]) else "  (no tinygemm in fp16)")
        print(f"{s['M']:5d}  {s['geomean_vs_cublas']:7.2f}x  {s['geomean_vs_cublas_big']:10.2f}x  "
              f"{s['min_vs_cublas']:7.2f}x" + vs_tinygemm)
    meta = env_meta(benchmark="w4a16", group_size=GROUP, activations=args.dtype, rounds=args.rounds, command=cmd,
                    summary=summary)
    paths = write_results(rows, meta, args.out, name, title=f"W4A16 speedup over cuBLAS {base_op} ({meta.get('gpu')})")
    print("wrote", paths)
    return 0
