"""GPTQ act-order with static groups (shipped) against groups formed in processing order (GPTQ's desc_act
checkpoints: each layer then needs its inputs permuted), SmolLM2-135M W4A16 g64, WikiText-2 perplexity.

`gptq_quantize_model` runs as shipped, or with `gptq_quantize_weight(static_groups=False)` swapped in; the
float model then holds each linear's dequantized weight in the original input order (so no permuted layers
are needed to score it), and is scored on the first 40,960 test tokens in 2,048-token windows (CPU: ~9 min a
row on 2 cores). Calibration: 128 x 512 tokens of the C4 excerpt, as `nibble quantize --method gptq`.

    python benchmarks/scripts/gptq_group_order.py static processing-order
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import nibble.quantize.gptq as gptq  # noqa: E402
from nibble.config import QuantConfig  # noqa: E402
from nibble.eval.perplexity import wikitext2_perplexity  # noqa: E402
from nibble.models.loading import load_model  # noqa: E402
from nibble.quantize.calibration import calibration_batches  # noqa: E402

SHIPPED = gptq.gptq_quantize_weight, gptq.dequantize


def processing_order_groups():
    """(quantize, dequantize) for gptq_quantize_model: groups in processing order, weights given back in
    the original input order (the last result's permutation undone)."""
    inverse = {}

    def quantize(*args, **kwargs):
        res = SHIPPED[0](*args, **{**kwargs, "static_groups": False})
        inverse["perm"] = None if res.perm is None else torch.argsort(res.perm)
        return res

    def dequantize(*args):
        w = SHIPPED[1](*args)
        return w if inverse.get("perm") is None else w[:, inverse["perm"]]
    return quantize, dequantize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="*", choices=("static", "processing-order"), default=["static", "processing-order"],
                    help="which groups to score (default: both)")
    rows = ap.parse_args().rows
    model, tok = load_model()
    calib = calibration_batches(tok, 128, 512, "c4")
    for row in rows:
        m = copy.deepcopy(model)
        gptq.gptq_quantize_weight, gptq.dequantize = processing_order_groups() if row == "processing-order" else SHIPPED
        try:
            t0 = time.time()
            gptq.gptq_quantize_model(m, QuantConfig(mode="w4a16", group_size=64, method="gptq"), calib, progress=False)
        finally:
            gptq.gptq_quantize_weight, gptq.dequantize = SHIPPED
        t1 = time.time()
        r = wikitext2_perplexity(m, tok, seq_len=2048, max_tokens=40960, batch_size=1, progress=False)
        print(f"{row}: ppl {r['ppl']:.3f} over {r['tokens']} tokens (GPTQ {t1 - t0:.0f} s, eval {time.time() - t1:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
