"""W4A4 kernel variants on one device call: correctness smoke first, then timings; short table last.
(Not run on the device yet: the session used `python -m nibble.bench.w4a4 --tune` instead. Configs
whose layout breaks the PTX unpack, see test_asm_unpack_layout, run with asm=False.)

PYTHONPATH=. python3 benchmarks/scripts/w4a4_explore.py [--quick]   (logs to $OUT/w4a4_explore.log)
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from nibble.bench.timing import bench_us, rotations, tee
from nibble.bench.w4a4 import random_w4a4, _dense_bf16
from nibble.kernels import reference
from nibble.kernels import w4a4 as W

OUT = os.environ.get("OUT", "/tmp")
log = tee(os.path.join(OUT, "w4a4_explore.log"))
TABLE = []


def mma(BM, BN, BK, w, s, split=None, asm=True, group=8):
    c = dict(kind="mma", SWAP=False, BM=BM, BN=BN, BK=BK, GROUP_M=group, num_warps=w, num_stages=s, asm=asm)
    if split is not None:
        c["split_k"] = split
    return c


def gemv(BN, BKW, split=None, w=4):
    c = dict(kind="gemv", MP=1, BN=BN, BKW=BKW, num_warps=w)
    if split is not None:
        c["split_k"] = split
    return c


def with_split(cfg, M, N, K):
    if "split_k" in cfg:
        return cfg
    c = dict(cfg)
    if cfg["kind"] == "mma":
        tiles = -(-M // c["BM"]) * -(-N // c["BN"])
        c["split_k"] = W._split_for(tiles, -(-K // c["BK"]), 132, 2.0 if M <= 64 else 1.0, 4 if M <= 64 else 8) \
            if tiles < 132 * (2.0 if M <= 64 else 1.0) else 1
    else:
        c["split_k"] = W._split_for(-(-N // c["BN"]), -(-K // 8 // c["BKW"]), 132, 4.0, 4)
    return c


def main():
    quick = "--quick" in sys.argv
    dev = torch.device("cuda")
    p = torch.cuda.get_device_properties(0)
    log(f"device {p.name} sms={p.multi_processor_count} l2={p.L2_cache_size >> 20}MB torch={torch.__version__}")
    import triton
    log("triton", triton.__version__)

    # ---- 1. correctness smoke of each kernel flavour (asm unpack, dp4a, split) ---------------------
    t0 = time.time()
    ok_all = True
    gen = torch.Generator().manual_seed(1)
    for (M, N, K, cfg) in [(64, 256, 512, mma(64, 128, 128, 4, 4, 1)), (300, 384, 1024, mma(128, 128, 128, 4, 3, 2)),
                           (1, 512, 1024, gemv(256, 16, 3)), (200, 512, 576, mma(128, 256, 128, 8, 3, 1)),
                           (7, 1000, 4096, mma(64, 128, 128, 4, 4, 4)), (64, 256, 512, mma(64, 128, 128, 4, 4, 1, asm=False))]:
        qw = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, generator=gen).to(dev)
        qx = torch.randint(-8, 8, (M, K), dtype=torch.int8, generator=gen).to(dev)
        ref = reference.w4a4_accumulate(qx, qw)
        acc = W.w4a4_accumulate_triton(qx, qw, config=cfg)
        ok = torch.equal(acc, ref)
        ok_all &= ok
        log(f"exact M={M} N={N} K={K} {cfg}: {'OK' if ok else 'WRONG %d' % (acc != ref).sum().item()}")
    x = (torch.randn(37, 4096, device=dev) * 3).bfloat16()
    x[0, 1] = float("nan")
    x[2] = 0
    q, s = W.quantize_activations(x)
    qr, sr = reference.quantize_activations(x)
    log("act-quant exact:", torch.equal(q, qr) and torch.equal(s, sr))
    from nibble.kernels.hadamard import hadamard_transform_triton
    for K in (576, 4096, 14336):
        x = torch.randn(33, K, device=dev).bfloat16()
        q, s = W.quantize_activations(x, True)
        q2, s2 = W.quantize_activations(hadamard_transform_triton(x), False)
        log(f"act-quant fused hadamard K={K} == unfused:", torch.equal(q, q2), torch.equal(s, s2))
    log(f"[smoke {time.time() - t0:.1f}s incl. compiles] all exact: {ok_all}")
    asm_ok = ok_all

    # ---- 2. timings -------------------------------------------------------------------------------
    shapes = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)] if not quick else [(4096, 4096), (28672, 8192)]
    plans = {
        1: [("gemv256x16", gemv(256, 16)), ("gemv128x16", gemv(128, 16)), ("gemv256x32", gemv(256, 32)),
            ("mma64x128", mma(64, 128, 128, 4, 4))],
        16: [("mma64x128s4", mma(64, 128, 128, 4, 4)), ("mma64x128s3", mma(64, 128, 128, 4, 3)),
             ("mma64x256w8", mma(64, 256, 128, 8, 3)), ("mma64x64k256", mma(64, 64, 256, 4, 4, asm=False))],
        128: [("mma128x128", mma(128, 128, 128, 4, 3)), ("mma64x128s4", mma(64, 128, 128, 4, 4)),
              ("mma128x256w8", mma(128, 256, 128, 8, 3))],
        1024: [("mma128x128", mma(128, 128, 128, 4, 3)), ("mma128x128s4", mma(128, 128, 128, 4, 4)),
               ("mma128x256w8", mma(128, 256, 128, 8, 3)), ("mma256x128w8", mma(256, 128, 128, 8, 3, asm=False)),
               ("mma128x128noasm", mma(128, 128, 128, 4, 3, asm=False))],
        4096: [("mma128x128", mma(128, 128, 128, 4, 3)), ("mma128x256w8", mma(128, 256, 128, 8, 3)),
               ("mma256x128w8", mma(256, 128, 128, 8, 3, asm=False))],
    }
    if not asm_ok:
        log("!!! asm unpack or a kernel is WRONG: timing asm=False variants only")
        for M in plans:
            plans[M] = [(n + "_noasm", dict(c, asm=False)) for n, c in plans[M] if c["kind"] == "mma"] + \
                       [(n, c) for n, c in plans[M] if c["kind"] == "gemv"]

    for N, K in shapes:
        n4 = rotations(K // 2 * N)
        w4 = [random_w4a4(N, K, dev) for _ in range(n4)]
        nb = rotations(2 * N * K)
        wb = [_dense_bf16(*w4[i % n4]) for i in range(nb)]
        for M, variants in plans.items():
            if quick and M == 4096:
                continue
            x = (torch.randn(M, K, device=dev)).bfloat16()
            qx, sx = W.quantize_activations(x)
            # compile every variant for this shape in parallel threads first (ptxas runs outside the GIL)
            t0 = time.time()
            cfgs = [(n, with_split(c, M, N, K)) for n, c in variants]
            with cf.ThreadPoolExecutor(8) as ex:
                futs = {ex.submit(W.w4a4_matmul_triton, qx, sx, w4[0][0], w4[0][1], None, torch.bfloat16,
                                  config=c): n for n, c in cfgs}
                for f in futs:
                    try:
                        f.result()
                    except Exception as e:
                        log(f"compile/run {futs[f]} failed: {type(e).__name__}: {str(e)[:300]}")
            torch.cuda.synchronize()
            tc = time.time() - t0
            bf = bench_us(lambda i: (lambda: F.linear(x, wb[i])), nb)
            row = dict(N=N, K=K, M=M, bf16=bf, compile_s=round(tc, 1))
            for n, c in cfgs:
                try:
                    us = bench_us(lambda i, c=c: (lambda: W.w4a4_matmul_triton(qx, sx, w4[i][0], w4[i][1], None,
                                                                                torch.bfloat16, config=c)), n4)
                except Exception as e:
                    us = None
                    log(f"time {n} failed: {type(e).__name__}: {str(e)[:200]}")
                row[n] = us
                log(f"N={N} K={K} M={M} {n:18s} split={c.get('split_k')} {us if us is None else round(us, 2)} us "
                    f"(bf16 {bf:.1f})")
            us_q = bench_us(lambda i: (lambda: W.quantize_activations_triton(x, False)), 1)
            us_qh = bench_us(lambda i: (lambda: W.quantize_activations_triton(x, True)), 1)
            row["actquant"], row["actquant_h"] = us_q, us_qh
            if M > 16:
                w8 = W.unpack_weight_int8(w4[0][0])
                row["int_mm"] = bench_us(lambda i: (lambda: torch._int_mm(qx, w8.t())), 1)
                try:
                    xf8 = qx.to(torch.float8_e4m3fn)
                    wf8 = w8.to(torch.float8_e4m3fn)
                    sa = sx[:, None].contiguous()
                    sb = torch.rand(1, N, device=dev)
                    row["fp8"] = bench_us(lambda i: (lambda: torch._scaled_mm(xf8, wf8.t(), scale_a=sa, scale_b=sb,
                                                                               out_dtype=torch.bfloat16)), 1)
                except Exception as e:
                    log("fp8 failed", type(e).__name__, str(e)[:200])
                if M >= 1024:
                    try:
                        c8 = dict(mma(128, 128, 128, 4, 3), split_k=1)
                        row["i8w_128x128"] = bench_us(lambda i: (lambda: W.w4a4_matmul_triton(
                            qx, sx, w4[0][0], w4[0][1], None, torch.bfloat16, config=c8, w_int8=w8)), 1)
                    except Exception as e:
                        log("int8-weight triton failed", type(e).__name__, str(e)[:200])
                del w8
            TABLE.append(row)
            log(json.dumps(row))
        del w4, wb
        torch.cuda.empty_cache()

    log("\n==== summary (us; bf16 = cuBLAS) ====")
    for r in TABLE:
        items = [f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()]
        log(" ".join(items))
    with open(os.path.join(OUT, "w4a4_explore.json"), "w") as f:
        json.dump(TABLE, f, indent=1)


if __name__ == "__main__":
    main()
