"""Where W4A4's rotate + quantize kernel (csrc/rotate_quantize.cu) should let the product after it
launch early (`w4a4.rotate_quantize_successor`). The op `torch.ops.nibble.w4a4_linear(...,
input_hadamard=True)` for up to 16 tokens, arms alternated over rounds in one process (CUDA graphs,
weights rotated past the L2, median):

  shipped       as `w4a4.rotate_quantize_successor` says
  trigger       rotate_quantize launched early, and letting the product launch early
  no_trigger    rotate_quantize launched early, the product launching when it ends
  plain         rotate_quantize launched the plain way (neither)
  triton        the Triton act-quant path instead, launched early

plus the parts alone (rotate_quantize, the product on ready codes) and the product's launch config;
then W4A4 + Hadamard decode of random-weight models, an engine per arm (trigger / no_trigger, its
graphs captured so), alternating rounds.

    PYTHONPATH=. python3 benchmarks/scripts/rotate_quantize_successor_ab.py --json ab.json
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
from rotate_quantize_ab import MODELS, Arm  # noqa: E402  (this folder)

SHAPES = [(4096, 4096), (11008, 4096), (12288, 4096), (14336, 4096), (28672, 8192), (4096, 11008), (4096, 14336),
          (3584, 18944), (18944, 3584), (8192, 28672)]
APPLICABLE, EARLY, SUCCESSOR = W.rotate_quantize_applicable, W.early_launch, W.rotate_quantize_successor
ARMS = ("shipped", "trigger", "no_trigger", "plain", "triton")


def use(arm: str) -> None:
    W.rotate_quantize_applicable = (lambda x: False) if arm == "triton" else APPLICABLE
    W.rotate_quantize_successor = {"trigger": lambda M, warps: True,
                                   "no_trigger": lambda M, warps: False}.get(arm, SUCCESSOR)
    # the act-quant kernels ask with the W4A4 pair's limit; the products with their own
    W.early_launch = EARLY if arm != "plain" else (
        lambda device, tokens=1, max_tokens=64: False if max_tokens == W.PRODUCT_EARLY_TOKENS
        else EARLY(device, tokens, max_tokens))


def model_rows(models: list[str], batches: list[int], rounds: int) -> list[dict]:
    rows = []
    for model_name in models:
        base, overrides = MODELS[model_name]
        model = speed.random_model(base, **overrides)
        speed.quantize_in_place(model, quant_config("w4a4-hadamard", model, clip_search=False))
        for batch in batches:
            engines = {arm: Arm(Engine(model, max_batch=batch, max_seq_len=512 + 160), arm, use, "shipped")
                       for arm in ("trigger", "no_trigger")}
            times = speed.alternating_decodes(engines, batch, 128, 128, rounds)
            for arm in engines:
                rows.append(dict(model=model_name, batch=batch, arm=arm, ms=round(statistics.median(times[arm]), 4),
                                 rounds=times[arm]))
                print(json.dumps(rows[-1]), flush=True)
            speed.release(*(a.engine for a in engines.values()))
        speed.release(model)
    return rows


def shape_rows(N: int, K: int, ms: list[int], rounds: int) -> list[dict]:
    n_rot = rotations(K // 8 * N * 4)
    weights = [random_w4a4(N, K, "cuda") for _ in range(n_rot)]
    rows = []
    for M in ms:
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        row = dict(N=N, K=K, M=M, rq_applies=APPLICABLE(x), mma=str(W.mma_config(M, [N], K, x.device)))
        use("shipped")
        qx, sx = W.quantize_activations_gpu(x, True)
        row["rotate_us"] = bench_us(lambda i: (lambda: W.quantize_activations_gpu(x, True)))
        row["product_us"] = bench_us(lambda i: (lambda: W.w4a4_matmul(qx, sx, *weights[i], None)), n_rot)
        times = {arm: [] for arm in ARMS}
        for r in range(rounds):
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                use(arm)
                times[arm].append(bench_us(lambda i: (lambda: torch.ops.nibble.w4a4_linear(
                    x, weights[i][0], weights[i][1], None, True)), n_rot))
        use("shipped")
        row.update({f"{arm}_us": round(statistics.median(v), 3) for arm, v in times.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,8,16", help="token counts of the op part (empty: skip it)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--model-rounds", type=int, default=4, help="even: each arm runs first as often")
    ap.add_argument("--json")
    args = ap.parse_args()
    speed.require_cuda("rotate_quantize_successor_ab")
    rows = []
    for N, K in SHAPES if args.ms else []:
        rows += shape_rows(N, K, [int(m) for m in args.ms.split(",")], args.rounds)
        torch.cuda.empty_cache()
    models = model_rows(args.models, [int(b) for b in args.batches.split(",")], args.model_rounds)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(command=" ".join(sys.argv)), "rows": rows,
                                               "models": models}, indent=1))


if __name__ == "__main__":
    main()
