"""W4A4's Hopper product with its CTAs in pairs that share x (csrc/w4a4_wgmma.cu: Pairs) and without,
in one process: pairs on / off alternated over rounds (CUDA graphs, weights rotated past the L2, median).

1. The product alone (`w4a4_wgmma_many`, bf16 out) on the issue-4 shapes and Llama-2-7B's grouped q/k/v and
   gate/up, at the tokens where pairs apply (one token tile): the config model's pick, and at 64 and 128
   tokens every unsplit tile. Every pair of outputs compared bit for bit first.
2. The op (quantize + product, `torch.ops.nibble.w4a4_linear`) at 128 tokens on the issue-4 shapes.
3. Llama-2-7B-shaped W4A4 prefills, one engine per setting, interleaved.

    PYTHONPATH=. python3 benchmarks/scripts/w4a4_pairs_ab.py --json ab.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.bench.w4a4 import random_w4a4  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.engine import Engine  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402
from nibble.kernels import w4a4 as W  # noqa: E402

SHAPES = {f"{n}x{k}": ([n], k) for n, k in [(4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008),
                                             (14336, 4096), (4096, 14336), (28672, 8192), (8192, 28672)]}
SHAPES.update({"llama2-qkv": ([4096] * 3, 4096), "llama2-gate-up": ([11008] * 2, 4096)})
SETTINGS = ("pairs", "single")
_SHIPPED_RULE = W.pairs_share_x


def set_pairs(on: bool) -> None:
    """Pairs where they apply (the shipped rule) or nowhere, for every launch that follows."""
    W.pairs_share_x = _SHIPPED_RULE if on else (lambda *a, **k: False)


def alternate(run, rounds: int) -> dict:
    """{setting: median us} of run() (a bench_us result) with pairs on and off, alternating."""
    times = {s: [] for s in SETTINGS}
    for r in range(rounds):
        for s in (SETTINGS if r % 2 == 0 else SETTINGS[::-1]):
            set_pairs(s == "pairs")
            times[s].append(run())
    set_pairs(True)
    return {s: statistics.median(v) for s, v in times.items()}


def product_times(ms, sweep_ms, rounds: int, shapes) -> list:
    rows = []
    for name, (widths, K) in SHAPES.items():
        if name not in shapes:
            continue
        n_rot = rotations(K // 8 * sum(widths) * 4)
        sets = [[random_w4a4(n, K, "cuda") for n in widths] for _ in range(n_rot)]
        for M in sorted(set(ms) | set(sweep_ms)):
            qx = torch.randint(-8, 8, (M, K), dtype=torch.int8, device="cuda")
            sx = torch.rand(M, device="cuda") + 0.5
            auto = W.wgmma_config(M, sum(widths), K, W.wgmma_clusters("cuda"), widths)
            cfgs = [("model", auto)] if M in ms else []
            if M in sweep_ms:
                cfgs += [(f"{bn}x{ch}", dict(bn=bn, channels=ch, split_k=1)) for bn, ch in W.wgmma_tiles(widths)
                         if M <= bn]
            for label, cfg in cfgs:
                def launch(i, pair):
                    return lambda: W.w4a4_wgmma_many(qx, sx, [(w, s, None) for w, s in sets[i]],
                                                     config=dict(cfg, pair=pair))
                outs = {p: launch(0, p)() for p in (True, False)}
                exact = all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
                paired = W.pairs_share_x(M, sum(widths), cfg["bn"], cfg["channels"], cfg["split_k"])
                t = {s: [] for s in SETTINGS}
                for r in range(rounds):
                    for s in (SETTINGS if r % 2 == 0 else SETTINGS[::-1]):
                        t[s].append(bench_us(lambda i: launch(i, s == "pairs"), n_rot))
                row = dict(shape=name, M=M, config=label, cfg=cfg, paired=paired, equal=exact,
                           **{f"{s}_us": statistics.median(v) for s, v in t.items()})
                row["speedup"] = row["single_us"] / row["pairs_us"]
                rows.append(row)
                print(json.dumps(row), flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


def op_times(rounds: int, shapes, M: int = 128) -> list:
    rows = []
    for name, (widths, K) in SHAPES.items():
        if len(widths) > 1 or name not in shapes:
            continue
        N = widths[0]
        n_rot = rotations(K // 8 * N * 4)
        weights = [random_w4a4(N, K, "cuda") for _ in range(n_rot)]
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        med = alternate(lambda: bench_us(lambda i: (lambda: torch.ops.nibble.w4a4_linear(
            x, weights[i][0], weights[i][1], None, False)), n_rot), rounds)
        bf16 = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(rotations(N * K * 2))]
        base = bench_us(lambda i: (lambda: torch.nn.functional.linear(x, bf16[i])), len(bf16))
        row = dict(shape=name, M=M, bf16_us=base, **{f"{s}_us": v for s, v in med.items()},
                   **{f"{s}_vs_bf16": base / v for s, v in med.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
        del weights, bf16
        torch.cuda.empty_cache()
    return rows


class Setting:
    """An engine whose W4A4 launches pair CTAs or not, set before each prefill (and so in the graphs it captures)."""

    def __init__(self, engine: Engine, pairs: bool):
        self.engine, self.pairs = engine, pairs

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prefill(self, *args, **kwargs):
        set_pairs(self.pairs)
        return self.engine.prefill(*args, **kwargs)


def prefill_times(shapes, rounds: int) -> dict:
    engines = {}
    for s in SETTINGS:
        model = speed.random_model("llama-2-7b")
        speed.quantize_in_place(model, quant_config("w4a4", model, clip_search=False))
        engines[s] = Setting(Engine(model, max_batch=max(b for b, _ in shapes), max_seq_len=max(t for _, t in shapes)),
                             s == "pairs")
    times = speed.alternating_prefills(engines, shapes, rounds)
    set_pairs(True)
    out = {f"{name} {b}x{t}": v for (name, (b, t)), v in times.items()}
    for key, v in out.items():
        print(key, [round(t, 3) for t in v], "median", round(statistics.median(v), 3), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="17,64,100,128", help="tokens for the model's pick")
    ap.add_argument("--sweep-ms", default="64,128", help="tokens for every unsplit tile")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill", default="1x128,1x64", help="batch x tokens of the prefills ('' for none)")
    ap.add_argument("--prefill-rounds", type=int, default=6)
    ap.add_argument("--parts", default="product,op,prefill")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    parts = args.parts.split(",")
    out = dict(meta=env_meta(benchmark="w4a4 pairs sharing x, on / off",
                             command="PYTHONPATH=. python3 benchmarks/scripts/w4a4_pairs_ab.py " + " ".join(sys.argv[1:])))
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    if "product" in parts:
        out["product"] = product_times(ints(args.ms), ints(args.sweep_ms), args.rounds, args.shapes.split(","))
    if "op" in parts:
        out["op"] = op_times(args.rounds, args.shapes.split(","))
    if "prefill" in parts and args.prefill:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.prefill.split(",")]
        out["prefill_ms"] = prefill_times(shapes, args.prefill_rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
