"""The skinny W4A16 kernel with and without its tail split (csrc/w4a16_mma.cu: Tail), every piece
count, on the layers whose 32-column blocks fall unevenly on the SMs, in alternating rounds; then,
with ``--decode``, Llama-2-7B / Llama-3-8B W4A16 decode with the op's tail split on and off.

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_tail_split_ab.py --json $OUT/tail-split-ab.json --decode

Every variant's outputs are checked against an fp32 product and against the launch without a tail
(the pieces add their sums in another order, so the two may differ by a rounding), and two calls
of each against each other (bit for bit).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import random_int4  # noqa: E402
from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402
from nibble.kernels.w4a16 import dequantize_cuda  # noqa: E402

G = 128
# name: (widths of the weights in one launch, K)
LAYERS = {"11008x4096": ([11008], 4096), "14336x4096": ([14336], 4096), "12288x4096": ([12288], 4096),
          "28672x8192": ([28672], 8192), "llama2-gate-up": ([11008] * 2, 4096),
          "llama3-gate-up": ([14336] * 2, 4096)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,8,16")
    ap.add_argument("--pieces", default="2,3,4,5,6,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--decode", action="store_true", help="also Llama-2-7B / Llama-3-8B W4A16 decode, split on / off")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = W.num_sms(dev)
    rows = []
    for name in args.layers.split(","):
        widths, K = LAYERS[name]
        blocks = sum(widths) // 32
        n_rot = rotations(sum(widths) * K // 2)
        sets = [[random_int4(n, K, G, dev) for n in widths] for _ in range(n_rot)]
        ref_w = torch.cat([dequantize_cuda(*w, G, dtype=torch.float32) for w in sets[0]])
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ ref_w.t()
            base = W.select_mma_config(M, sum(widths), K, sms)
            plain = W.MmaConfig(base.token_tiles, base.warps, base.x_l1, base.successor)
            variants = {"none": plain}
            tail = blocks % sms
            if tail and blocks >= sms and plain.token_tiles <= 2:
                for p in (int(v) for v in args.pieces.split(",")):
                    variants[f"p{p}"] = W.MmaConfig(plain.token_tiles, plain.warps, plain.x_l1, plain.successor, tail, p)
            picked = W.select_mma_config(M, sum(widths), K, sms, G)
            outs = {}
            for v, cfg in variants.items():
                y = torch.cat(W.w4a16_mma_many(x, sets[0], G, config=cfg), 1)
                again = torch.cat(W.w4a16_mma_many(x, sets[0], G, config=cfg), 1)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                assert torch.equal(y, again), f"{name} M={M} {v}: two calls differ"
                assert err < 1e-2 and torch.isfinite(y).all(), f"{name} M={M} {v}: rel err {err}"
                outs[v] = y
                if v != "none":
                    diff = (y.float() - outs["none"].float()).abs().max().item()
                    scale = outs["none"].float().abs().max().item()
                    assert diff <= 2 ** -6 * scale, f"{name} M={M} {v}: {diff} from the untailed launch"
            times = {v: [] for v in variants}
            for r in range(args.rounds):
                for v in speed.round_order(variants, r):
                    cfg = variants[v]
                    times[v].append(bench_us(lambda i, c=cfg: (lambda: W.w4a16_mma_many(x, sets[i], G, config=c)),
                                             n_rot, warmup_ms=10, reps=20))
            us = {v: statistics.median(t) for v, t in times.items()}
            best = min(us, key=us.get)
            rows.append(dict(layer=name, M=M, blocks=blocks, sms=sms, warps=plain.warps, us=us, best=best,
                             picked=[picked.tail_blocks, picked.pieces], rounds=times))
            print(f"{name:15s} M={M:3d} blocks {blocks} ({blocks / sms:.2f}/SM) warps {plain.warps} picked "
                  f"{picked.tail_blocks}x{picked.pieces}: " + "  ".join(f"{v} {t:.2f}" for v, t in us.items())
                  + f"  | best {best} x{us['none'] / us[best]:.3f}", flush=True)
        sets = None  # free this layer's weights before the next is built
        torch.cuda.empty_cache()
    decode = []
    if args.decode:
        decode = decode_ab(dev, args.rounds)
    Path(args.json).write_text(json.dumps(dict(meta=env_meta(benchmark="w4a16-tail-split-ab", command=" ".join(sys.argv)),
                                               rows=rows, decode=decode), indent=1))


def decode_ab(dev, rounds: int) -> list:
    """Llama-shaped W4A16 decode, ms a step, with the op's tail split and with none: the second engine
    captures its decode graph while ``select_mma_config`` is patched to leave the split out (the graph
    keeps the launches it captured), then both run in alternating rounds."""
    from nibble.eval.engine import Engine
    from nibble.eval.report import quant_config
    pick = W.select_mma_config

    def no_tail(M, N, K, num_sms=W.NUM_SMS_DEFAULT, group_size=None):
        return pick(M, N, K, num_sms)
    out = []
    for model_name in ("llama-2-7b", "llama-3-8b"):
        model = speed.random_model(model_name)
        speed.quantize_in_place(model, quant_config("w4a16", model, clip_search=False))
        for batch in (1, 8):
            engines = {k: Engine(model, max_batch=batch, max_seq_len=128 + 160) for k in ("tail", "none")}
            speed.measure_decode(engines["tail"], batch, 128, 8, reps=1)  # captures with the split
            W.select_mma_config = no_tail
            try:
                speed.measure_decode(engines["none"], batch, 128, 8, reps=1)  # captures without
            finally:
                W.select_mma_config = pick
            times = speed.alternating_decodes(engines, batch, 128, 128, 2 * rounds)
            med = {k: statistics.median(v) for k, v in times.items()}
            out.append(dict(model=model_name, batch=batch, ms_per_step=med, rounds=times,
                            speedup=med["none"] / med["tail"]))
            print(f"{model_name} W4A16 decode batch {batch}: tail split {med['tail']:.4f} ms/step, none "
                  f"{med['none']:.4f} (x{med['none'] / med['tail']:.3f})", flush=True)
            for e in engines.values():
                e.close()
            speed.release()
        speed.release(model)
    return out


if __name__ == "__main__":
    main()
