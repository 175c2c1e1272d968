"""x resident in the skinny W4A16 kernel (copied once per CTA, each warp its own K range) against x
copied through the ring every step, at one token tile: kernel level on the issue's layers and the
grouped decode launches, and Llama-2-7B W4A16 decode with each way captured in its own graph.

    PYTHONPATH=. python3 benchmarks/scripts/x_resident_ab.py --json $OUT/x-resident-ab.json

Same timing as ``python -m nibble.bench kernels`` (CUDA-graph replay, weights rotated past the L2,
median), the two ways alternating over rounds in one process; outputs compared bit for bit.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import random_int4  # noqa: E402
from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.engine import Engine  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402

LAYERS = {f"{n}x{k}": ([n], k) for n, k in ((4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008), (14336, 4096),
                                            (4096, 14336), (28672, 8192), (8192, 28672))}
LAYERS.update({"llama2-qkv": ([4096] * 3, 4096), "llama2-gate-up": ([11008] * 2, 4096),
               "llama3-qkv": ([4096, 1024, 1024], 4096), "llama3-gate-up": ([14336] * 2, 4096)})


def resident(cfg: W.MmaConfig, M: int) -> W.MmaConfig:
    return replace(cfg, x_l1=False, x_resident=True, successor=W.successor_launch(1, M, False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", default="1,4", help="decode batches ('' for none)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    dev, G = torch.device("cuda"), 128
    rows = []
    for label, (ns, K) in LAYERS.items():
        n_rot = rotations(sum(n * K // 2 for n in ns))
        weights = [[random_int4(n, K, G, dev) for n in ns] for _ in range(n_rot)]
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            shipped = W.select_mma_config(M, sum(ns), K, W.num_sms(dev))
            ways = {"shipped": shipped, "resident": resident(shipped, M)}
            if not W.mma_config_valid(ways["resident"], M, K):
                continue
            outs = {w: W.w4a16_mma_many(x, weights[0], G, config=c) for w, c in ways.items()}
            same = all(torch.equal(a, b) for a, b in zip(outs["shipped"], outs["resident"]))
            times: dict = {}
            for r in range(args.rounds):
                for way in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                    times.setdefault(way, []).append(bench_us(
                        lambda i, c=ways[way]: (lambda: W.w4a16_mma_many(x, weights[i], G, config=c)), n_rot))
            base = statistics.median(times["shipped"])
            for way, t in times.items():
                us = statistics.median(t)
                rows.append(dict(layer=label, M=M, way=way, us=us, rounds=t, speedup=base / us, bit_exact=same,
                                 config=str(ways[way])))
            print(f"{label:15s} M={M} shipped {base:7.2f} resident {statistics.median(times['resident']):7.2f} us "
                  f"({base / statistics.median(times['resident']):.3f}x) {'bit-exact' if same else 'DIFFER'}", flush=True)
    select = W.select_mma_config
    for batch in (int(b) for b in args.batches.split(",") if b):
        model = speed.random_model("llama-2-7b")
        speed.quantize_in_place(model, quant_config("w4a16", model, clip_search=False))
        engines, tokens = {}, {}
        prompt = torch.randint(1, 1000, (batch, 16), generator=torch.Generator().manual_seed(0)).cuda()
        for way in ("shipped", "resident"):
            if way == "resident":  # the decode graph is captured with this selection
                W.select_mma_config = lambda M, N, K, sms=W.NUM_SMS_DEFAULT: (
                    lambda c: resident(c, M) if c.token_tiles == 1 and W.mma_config_valid(resident(c, M), M, K) else c
                )(select(M, N, K, sms))
            engines[way] = Engine(model, max_batch=batch, max_seq_len=128 + 160)
            tokens[way] = engines[way].generate(prompt, 12).tolist()
            W.select_mma_config = select
        times = speed.alternating_decodes(engines, batch, 128, 128, 4)
        base = statistics.median(times["shipped"])
        for way, t in times.items():
            rows.append(dict(model="llama-2-7b", batch=batch, way=way, ms_per_step=statistics.median(t), rounds=t,
                             speedup=base / statistics.median(t), same_tokens=tokens[way] == tokens["shipped"]))
            print(f"llama-2-7b w4a16 decode b={batch} {way:9s} {statistics.median(t):.4f} ms/step "
                  f"({base / statistics.median(t):.3f}x) {t}", flush=True)
        for e in engines.values():
            e.close()
        speed.release(model)
    Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
