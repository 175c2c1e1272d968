"""GPTQ wall time and peak GPU memory on a Llama-2-7B-shaped model (random weights), as JSON.

    python benchmarks/scripts/gptq_7b.py --json benchmarks/results/gptq-7b-h200.json   # H200
    python benchmarks/scripts/gptq_7b.py --save-calib ids.pt    # tokenize here; then on the GPU machine
    python benchmarks/scripts/gptq_7b.py --calib-file ids.pt --json gptq-7b-h200.json
    python benchmarks/scripts/gptq_7b.py --tiny                                         # CPU smoke run

The model is a ``transformers`` LlamaForCausalLM with Llama-2-7B's shape (hidden 4096, intermediate
11008, 32 layers, 32 heads, vocab 32000), bf16, weights drawn with std 0.02 (accuracy is not
measured: random weights only make the run's cost real). It is quantized by
``quantize_model(QuantConfig(method="gptq", group_size=128))``, i.e. nibble's shipped GPTQ (act-order
with static groups, GPTQ-weighted clipping, true-sequential), timed from the calibration ids on
the device to the last QuantLinear built. Calibration: windows of the C4 excerpt from ``--data`` /
``$NIBBLE_DATA`` tokenized with the SmolLM2 tokenizer (ids folded into the 32000 vocab by modulo),
or uniformly random ids when the tokenizer or the text is not available; the JSON says which.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.config import QuantConfig  # noqa: E402
from nibble.eval.speed import SPEED_MODELS, random_model  # noqa: E402
from nibble.models.convert import quantize_model  # noqa: E402
from nibble.nn import QuantLinear  # noqa: E402

LLAMA2_7B = {k: v for k, v in SPEED_MODELS["llama-2-7b"].items()
             if k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "vocab_size")}
TINY = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=32000)


def calibration_ids(n_samples: int, seq_len: int, vocab: int, tokenizer_model=None) -> tuple[torch.Tensor, str]:
    try:
        from nibble.models.loading import load_model
        from nibble.quantize.calibration import calibration_batches

        _, tokenizer = load_model(tokenizer_model)
        ids = calibration_batches(tokenizer, n_samples, seq_len, "c4")
        return ids % vocab, "C4 excerpt, SmolLM2 tokenizer, ids mod vocab"
    except (FileNotFoundError, ImportError, ValueError) as e:
        print(f"calibration text unavailable ({type(e).__name__}: {e}); using random token ids", flush=True)
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab, (n_samples, seq_len), generator=g), "uniform random ids"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 256: a quick run that works on the CPU")
    ap.add_argument("--data", default=None, help="shared data folder (default: $NIBBLE_DATA or ../shared/data)")
    ap.add_argument("--n-samples", type=int, default=None, help="calibration windows (default 64, --tiny 8)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per window (default 2048, --tiny 128)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--device", default=None, help="default: cuda if available")
    ap.add_argument("--json", default=None)
    ap.add_argument("--calib-file", default=None, help="torch.save'd LongTensor [n, seq] of token ids to use instead")
    ap.add_argument("--save-calib", default=None, help="only tokenize the calibration text into this file and exit "
                    "(on a machine with the tokenizer; carry the file to the GPU machine for --calib-file)")
    ap.add_argument("--tokenizer-model", default=None, help="model whose tokenizer cuts the calibration text "
                    "(a .gguf or HF folder; default: the embedded SmolLM2)")
    args = ap.parse_args()
    if args.data:
        os.environ["NIBBLE_DATA"] = args.data
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = TINY if args.tiny else LLAMA2_7B
    n_samples = args.n_samples or (8 if args.tiny else 64)
    seq_len = args.seq_len or (128 if args.tiny else 2048)

    if args.save_calib:
        calib, calib_source = calibration_ids(n_samples, seq_len, shape["vocab_size"], args.tokenizer_model)
        torch.save(calib, args.save_calib)
        print(f"wrote {tuple(calib.shape)} ids ({calib_source}) to {args.save_calib}")
        return
    if args.calib_file:  # ids tokenized elsewhere (the GPU machine may lack the tokenizer's model file)
        calib = torch.load(args.calib_file)[:n_samples, :seq_len] % shape["vocab_size"]
        calib_source = f"{args.calib_file} (C4 excerpt, SmolLM2 tokenizer), ids mod vocab"
    else:
        calib, calib_source = calibration_ids(n_samples, seq_len, shape["vocab_size"], args.tokenizer_model)
    torch.manual_seed(0)
    t0 = time.time()
    # built on the device in bf16 (a 7B init in fp32 on the CPU would take minutes and 27 GB), as the speed
    # benchmarks build theirs
    model = random_model("llama-2-7b", device=device, **shape)
    print(f"built {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B-parameter model on {device} "
          f"in {time.time() - t0:.0f}s", flush=True)

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        weights_bytes = torch.cuda.memory_allocated()
    cfg = QuantConfig(mode="w4a16", group_size=args.group_size, method="gptq")
    t1 = time.time()
    quantize_model(model, cfg, calibration=calib.to(device))
    if cuda:
        torch.cuda.synchronize()
    wall = time.time() - t1
    peak = torch.cuda.max_memory_allocated() if cuda else None

    n_quant = sum(isinstance(m, QuantLinear) for m in model.modules())
    with torch.no_grad():
        logits = model(calib[:1, :128].to(device)).logits
    finite = bool(torch.isfinite(logits).all())
    result = dict(
        shape="tiny" if args.tiny else "llama-2-7b", **shape, dtype="bfloat16", device=str(device),
        device_name=torch.cuda.get_device_name(device) if cuda else "cpu", torch=torch.__version__,
        method="gptq", group_size=args.group_size, calibration_shape=list(calib.shape), calibration=calib_source,
        quantized_linears=n_quant, wall_s=round(wall, 1),
        weights_gib=round(weights_bytes / 2 ** 30, 2) if cuda else None,
        max_memory_allocated_gib=round(peak / 2 ** 30, 2) if cuda else None, logits_finite=finite)
    print(json.dumps(result, indent=2), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if not finite or n_quant != 7 * shape["num_hidden_layers"]:
        raise SystemExit("quantized model is broken: non-finite logits or missing QuantLinears")


if __name__ == "__main__":
    main()
