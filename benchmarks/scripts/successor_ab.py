"""When the skinny matmuls let the next kernel launch (csrc/skinny.cuh: Successor), A/B in one
process: the package's rules (`w4a16.successor_launch`, `w4a4.mma_successor`) against the successor
launching at the end (the behaviour before session 22). First each op back to back on rotated weights
(W4A16 `w4a16_mma_many`, W4A4 `w4a4_mma_many`; the kernel benchmark's timing), both ways
`--kernel-rounds` times in alternating order, median; outputs compared bit for bit. Then the engine's
decode of random-weight models, one engine per way (each captures its graphs under it), in
alternating rounds.

    PYTHONPATH=. python3 benchmarks/scripts/successor_ab.py --json $OUT/successor-ab.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import GROUP, TIMING, random_int4  # noqa: E402
from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.bench.w4a4 import random_w4a4  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.engine import Engine  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402
from nibble.kernels import launch  # noqa: E402
from nibble.kernels import w4a4 as W4  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402

WAYS = ("rule", "at_end")
SHAPES = [(4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336),
          (28672, 8192), (8192, 28672)]
GROUPED = {"qkv 3x4096x4096": [(4096, 4096)] * 3, "gate/up 2x11008x4096": [(11008, 4096)] * 2}


@contextlib.contextmanager
def way(name: str):
    """The package as it is ("rule"), or with every skinny launch's successor at the end."""
    saved = W.successor_launch, W4.mma_successor
    if name == "at_end":
        W.successor_launch = W4.mma_successor = lambda *_a, **_k: launch.SUCCESSOR_AT_END
    W.select_mma_config.cache_clear()  # its configs hold the successor mode: memoized, they would outlive the swap
    try:
        yield
    finally:
        W.successor_launch, W4.mma_successor = saved
        W.select_mma_config.cache_clear()


def kernel_ab(ms, rounds: int, say=print) -> list[dict]:
    dev = torch.device("cuda")
    cases = [(f"{n}x{k}", [(n, k)]) for n, k in SHAPES] + list(GROUPED.items())
    rows = []
    for label, shapes in cases:
        K = shapes[0][1]
        codes = sum(n * K // 2 for n, _ in shapes)
        w16 = [[random_int4(n, K, GROUP, dev) for n, _ in shapes]
               for _ in range(rotations(codes + sum(4 * (K // GROUP) * n for n, _ in shapes)))]
        w4 = [[(*random_w4a4(n, K, dev), None) for n, _ in shapes] for _ in range(rotations(codes))]
        wb = None
        if len(shapes) == 1:
            n = shapes[0][0]
            wb = [torch.randn(n, K, device=dev, dtype=torch.bfloat16) for _ in range(rotations(2 * n * K))]
        for M in ms:
            if len(shapes) > 1 and M > W.MMA_MANY_MAX_M:
                continue
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            qx, sx = W4.quantize_activations(x, order="natural")
            ops = {"w4a16": (lambda i: (lambda: W.w4a16_mma_many(x, w16[i], GROUP)), len(w16)),
                   "w4a4": (lambda i: (lambda: W4.w4a4_mma_many(qx, sx, w4[i])), len(w4))}
            res = {}
            if wb is not None:
                res["bf16"] = bench_us(lambda i: (lambda: F.linear(x, wb[i])), len(wb), **TIMING)
            for op, (factory, n_rot) in ops.items():
                outs = {}
                for name in WAYS:
                    with way(name):
                        outs[name] = factory(0)()
                torch.cuda.synchronize()
                exact = all(torch.equal(a, b) for a, b in zip(outs["rule"], outs["at_end"]))
                times = {name: [] for name in WAYS}
                for r in range(rounds):
                    for name in (WAYS if r % 2 == 0 else WAYS[::-1]):
                        with way(name):
                            times[name].append(bench_us(factory, n_rot, **TIMING))
                for name in WAYS:
                    res[f"{op}/{name}"] = statistics.median(times[name])
                    rows.append(dict(case=label, M=M, op=op, way=name, us=round(res[f"{op}/{name}"], 3),
                                     rounds=[round(t, 3) for t in times[name]], exact=exact,
                                     successor=W4.mma_successor(M) if op == "w4a4" else
                                     W.select_mma_config(M, sum(n for n, _ in shapes), K).successor))
                if not exact:
                    say(f"MISMATCH {label} M={M} {op}")
            if "bf16" in res:
                rows.append(dict(case=label, M=M, op="bf16", us=round(res["bf16"], 3)))
            say(f"{label:22s} M={M:2d} " + " ".join(
                f"{op} {res[op + '/at_end']:7.2f} -> {res[op + '/rule']:7.2f} us "
                f"({res[op + '/at_end'] / res[op + '/rule']:.3f}x)" for op in ops)
                + (f" | bf16 {res['bf16']:.1f}" if "bf16" in res else ""))
        w16 = w4 = wb = None
        torch.cuda.empty_cache()
    return rows


def decode_ab(config: str, model_name: str, batches, rounds: int, say=print) -> list[dict]:
    model = speed.random_model(model_name)
    speed.quantize_in_place(model, quant_config(config, model, clip_search=False))
    rows = []
    for batch in batches:
        engines, tokens = {}, {}
        for name in WAYS:
            with way(name):
                engines[name] = Engine(model, max_batch=batch, max_seq_len=128 + 160)
                speed.measure_decode(engines[name], batch, 128, 8, reps=1)  # captures under this way
                tokens[name] = engines[name].generate(torch.arange(1, 9, device="cuda")[None], 6)[0].tolist()
        times = speed.alternating_decodes(engines, batch, 128, 128, rounds)  # graphs captured above: no way needed
        ms = {name: statistics.median(times[name]) for name in WAYS}
        for name in WAYS:
            rows.append(dict(case=f"decode {model_name}", config=config, batch=batch, way=name, ms_per_step=ms[name],
                             rounds=times[name], tokens_per_s=1000 * batch / ms[name],
                             same_tokens=tokens[name] == tokens["at_end"]))
        say(f"decode {config:6s} {model_name:12s} b={batch:2d} at_end {ms['at_end']:.4f} -> rule {ms['rule']:.4f} "
            f"ms/step ({ms['at_end'] / ms['rule']:.3f}x) tokens {'same' if rows[-1]['same_tokens'] else 'DIFFER'}")
        speed.release(*engines.values())
    speed.release(model)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--kernel-rounds", type=int, default=4, help="even: each way runs first as often")
    ap.add_argument("--configs", nargs="*", default=["w4a16", "w4a4"])
    ap.add_argument("--models", nargs="*", default=["llama-2-7b", "llama-3-8b"], choices=list(speed.SPEED_MODELS))
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--rounds", type=int, default=4, help="decode rounds, even")
    ap.add_argument("--json")
    args = ap.parse_args()
    speed.require_cuda("successor_ab")
    rows = []

    def save():  # after every part: a run cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))
    if args.kernel_rounds:
        rows += kernel_ab([int(m) for m in args.ms.split(",")], args.kernel_rounds)
        save()
    for config in args.configs:
        for name in args.models:
            rows += decode_ab(config, name, [int(b) for b in args.batches.split(",")], args.rounds)
            save()


if __name__ == "__main__":
    main()
