"""One device call: check every W4A16 kernel variant for correctness, then time them.

PYTHONPATH=. python3 benchmarks/scripts/w4a16_explore.py [--part decode,gemm] ; writes $OUT/explore.json
Prints a short table last. Used to fill nibble/kernels/w4a16.py's DISPATCH table.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F

from nibble.bench.kernels import random_int4, tinygemm_mm, tinygemm_pack
from nibble.bench.timing import bench_us, rotations, tee
from nibble.kernels import w4a16 as W
from nibble.kernels.reference import dequantize

OUT = os.environ.get("OUT", "/tmp")
P = print  # main: tee(OUT/explore.log) (not opened on import)
RESULTS = []


C = W.Config
DECODE = {
    "V1_512k64w4": C(kind="gemv", block_n=512, block_k=64, num_warps=4, num_stages=1),
    "V2_512k64w4s2": C(kind="gemv", block_n=512, block_k=64, num_warps=4, num_stages=2),
    "V3_256k64w2": C(kind="gemv", block_n=256, block_k=64, num_warps=2, num_stages=1),
    "V4_512k32w4": C(kind="gemv", block_n=512, block_k=32, num_warps=4, num_stages=1),
    "V5_512k64w4_4wave": C(kind="gemv", block_n=512, block_k=64, num_warps=4, num_stages=1, waves=4.0),
    "D1_tr_n64w4s3": C(block_m=16, block_n=64, num_warps=4, num_stages=3, trans=True),
    "D2_tr_n64w4s4": C(block_m=16, block_n=64, num_warps=4, num_stages=4, trans=True),
    "D3_tr_n64w4s3_4wave": C(block_m=16, block_n=64, num_warps=4, num_stages=3, trans=True, waves=4.0),
    "D4_tr_n64w4s3_a1": C(block_m=16, block_n=64, num_warps=4, num_stages=3, trans=True, dq_asm=1),
}
GEMM = {
    "G6_128x256k64w8": C(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, factored=False),
}


def with_split(cfg, M, N, K, G=128):
    return W.with_split(cfg, M, N, K, G, 132)


def check(name, cfg, M, N, K, G, dtype):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    qw, s, z = random_int4(N, K, G, dev)
    x = torch.randn(M, K, device=dev, dtype=dtype)
    wf = dequantize(qw, s, z, G)  # fp32 [N, K]
    ref = x.double() @ wf.double().t()
    base = (x @ wf.to(dtype).t()).double()
    out = torch.full((M, N), float("nan"), device=dev, dtype=dtype)
    c = with_split(cfg, M, N, K, G)
    W._launch(x, qw, s, z, G, c, out=out)
    if dev == "cuda":
        torch.cuda.synchronize()
    fin = bool(torch.isfinite(out).all())
    e = ((out.double() - ref).norm() / ref.norm()).item()
    eb = ((base - ref).norm() / ref.norm()).item()
    ok = fin and e <= 2 * eb + 1e-6
    return ok, e, eb, c.split_k


def time_cfg(cfg, M, N, K, G, sets, x):
    c = with_split(cfg, M, N, K)
    return bench_us(lambda i: (lambda: W._launch(x, sets[i][0], sets[i][1], sets[i][2], G, c)), len(sets),
                    warmup_ms=10, reps=20), c.split_k


def ceilings():
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    us = bench_us(lambda i: (lambda: b.copy_(a)), 1, warmup_ms=10, reps=10)
    P(f"copy 1 GiB: {us:.0f} us -> {2 * n / us / 1e3:.0f} GB/s (read + write)")
    v = a.view(torch.bfloat16)
    us = bench_us(lambda i: (lambda: v.sum(dtype=torch.float32)), 1, warmup_ms=10, reps=10)
    P(f"sum 1 GiB bf16: {us:.0f} us -> {n / us / 1e3:.0f} GB/s (read)")
    RESULTS.append(dict(kind="ceiling", read_GBps=n / us / 1e3))
    a = b = None  # freed (not del: the lambdas above close over them)


def run_part(shapes, ms, variants, G=128, extra=True):
    table = []
    for (N, K) in shapes:
        int4_bytes = K // 8 * N * 4 + 2 * (K // G) * N * 2
        n4 = rotations(int4_bytes)
        sets = [random_int4(N, K, G, "cuda") for _ in range(n4)]
        nb = rotations(N * K * 2)
        wb = [W.dequantize_cuda(*sets[i % n4], G) for i in range(nb)] if extra else None
        tg = None
        if extra:
            try:
                tg = [tinygemm_pack(*sets[i], G) for i in range(n4)]
            except Exception as e:
                P("tinygemm pack failed", type(e).__name__, str(e)[:300])
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            row = dict(N=N, K=K, M=M)
            if extra:
                row["bf16"] = bench_us(lambda i: (lambda: F.linear(x, wb[i])), nb, warmup_ms=10, reps=20)
                if tg is not None:
                    try:
                        row["tinygemm"] = bench_us(lambda i: (lambda: tinygemm_mm(x, tg[i][0], tg[i][1], G)), n4,
                                                   warmup_ms=10, reps=20)
                    except Exception as e:
                        P("tinygemm failed", M, type(e).__name__, str(e)[:200])
                if M >= 128:
                    wk = torch.empty((N, K), device="cuda", dtype=torch.bfloat16)
                    row["dq+cublas"] = bench_us(
                        lambda i: (lambda: F.linear(x, W.dequantize_cuda(*sets[i], G, out=wk))), n4,
                        warmup_ms=10, reps=20)
            for name, cfg in variants.items():
                if cfg.kind == "gemv" and M > 2:
                    continue
                try:
                    us, sk = time_cfg(cfg, M, N, K, G, sets, x)
                    row[name] = us
                    row[name + "_sk"] = sk
                except Exception as e:
                    P(f"  {name} M={M} N={N} K={K} failed: {type(e).__name__}: {str(e)[:300]}")
            fl = 2 * M * N * K
            best = min((v, k) for k, v in row.items() if k[0] in "DVG" and not k.endswith("_sk"))
            P(f"N={N} K={K} M={M}: bf16 {row.get('bf16', 0):.1f}  tg {row.get('tinygemm', 0):.1f}  "
              f"dq+cublas {row.get('dq+cublas', 0):.1f}  best {best[1]} {best[0]:.1f} us "
              f"(x{row.get('bf16', 0) / best[0]:.2f} bf16, {int4_bytes / best[0] / 1e3:.0f} GB/s, {fl / best[0] / 1e6:.0f} TF/s)")
            P("   " + "  ".join(f"{k}={v:.1f}" for k, v in row.items() if k[0] in "DVG" and not k.endswith("_sk")))
            table.append(row)
            RESULTS.append(row)
        sets = wb = tg = None  # freed (not del: the lambdas above close over them)
        torch.cuda.empty_cache()
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="check,decode,gemm")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    global P
    P = tee(os.path.join(OUT, "explore.log"))
    parts = args.part.split(",")
    t0 = time.time()
    P(torch.cuda.get_device_name(), torch.__version__, W.triton.__version__)
    global DECODE, GEMM
    if args.only:
        keep = args.only.split(",")
        DECODE = {k: v for k, v in DECODE.items() if any(k.startswith(p) for p in keep)}
        GEMM = {k: v for k, v in GEMM.items() if any(k.startswith(p) for p in keep)}
    bad = set()
    if "check" in parts:
        # bf16 cases reuse the specialisations that are timed later (compile once)
        main_cases = [(1, 4096, 4096, 128, torch.bfloat16), (2, 4096, 4096, 128, torch.bfloat16),
                      (16, 4096, 4096, 128, torch.bfloat16)]
        for name, cfg in {**DECODE, **GEMM}.items():
            cases = main_cases
            for (M, N, K, G, dt) in cases:
                if cfg.kind == "gemv" and M > 2:
                    continue
                if name.startswith("G") and M < 16:
                    continue
                if name.startswith("D") and M > 64:
                    continue
                try:
                    ok, e, eb, sk = check(name, cfg, M, N, K, G, dt)
                except Exception as ex:
                    ok, e, eb, sk = False, float("nan"), float("nan"), -1
                    P(f"  {name} check crashed: {type(ex).__name__}: {str(ex)[:400]}")
                    P(traceback.format_exc())
                if not ok:
                    bad.add(name)
                P(f"check {name:22s} M={M:4d} N={N} K={K} G={G} {str(dt)[6:]:8s} sk={sk}: err {e:.2e} base {eb:.2e} {'ok' if ok else 'FAIL'}")
        P(f"checks done in {time.time() - t0:.0f}s; failing: {sorted(bad)}")
    DECODE = {k: v for k, v in DECODE.items() if k not in bad}
    GEMM = {k: v for k, v in GEMM.items() if k not in bad}
    if "ceil" in parts:
        ceilings()
    if "decode" in parts:
        run_part([(4096, 4096), (28672, 8192)], [1, 2, 16], DECODE)
        P(f"decode done at {time.time() - t0:.0f}s")
    if "gemm" in parts:
        run_part([(4096, 4096), (28672, 8192)], [128, 1024, 4096], GEMM)
        P(f"gemm done at {time.time() - t0:.0f}s")
    with open(os.path.join(OUT, "explore.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
