"""PE-QAT on SmolLM2-135M: WikiText-2 test perplexity of 16-bit, W4A4 RTN (per-token, Hadamard)
and PE-QAT (per-token, Hadamard), written as JSON. ``--inits rtn,gptq`` also trains each recipe from
GPTQ's weights (and adds the W4A4 GPTQ rows those runs start from).

    python benchmarks/scripts/qat_smollm2.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --steps 100 --seq-len 1024 --batch-size 8 --json benchmarks/results/qat-smollm2.json

Protocol: every W4A4 model is the real deployed format (quantize_model or qat.export ->
save_quantized -> load_quantized in bf16), run by the reference W4A4 path (the spec the kernels are
tested against), and scored by `wikitext2_perplexity` (whole test split, 2048-token windows).
The 16-bit row is the same float model in bf16. PE-QAT trains on the C4 excerpt + Pride and
Prejudice (never WikiText-2), objective KL to the 16-bit model.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.config import QuantConfig  # noqa: E402
from nibble.eval.perplexity import wikitext2_perplexity  # noqa: E402
from nibble.models.convert import quantize_model, set_backend  # noqa: E402
from nibble.models.loading import load_model  # noqa: E402
from nibble.models.serialization import load_quantized, save_quantized  # noqa: E402
from nibble.qat.train import export, learns_quantization, run_qat  # noqa: E402
from nibble.quantize.calibration import calibration_batches  # noqa: E402


def log(*a):
    print(*a, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--recipes", default="per-token,hadamard")
    ap.add_argument("--inits", default="rtn", help="comma-separated PE-QAT starts: rtn, gptq")
    ap.add_argument("--steps", type=int, default=100, help="steps per recipe (the most, with --train-seconds)")
    ap.add_argument("--train-seconds", type=float, default=None,
                    help="fit the step count to this many seconds per recipe, timed by a 4-step probe run")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--quant-lr", type=float, default=1e-2, help="for the recipes that learn clip ratios (not hadamard)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--objective", default="kl")
    ap.add_argument("--no-gradient-checkpointing", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=None, help="cut the WikiText-2 stream (quick CPU checks)")
    ap.add_argument("--ppl-seq-len", type=int, default=None)
    ap.add_argument("--ppl-batch-size", type=int, default=8)
    ap.add_argument("--backend", default="reference", help="W4A4 backend for evaluation: reference | auto | triton")
    ap.add_argument("--tasks-limit", type=int, default=0, help="also run the seven tasks on this many docs each")
    ap.add_argument("--skip-rtn", action="store_true")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()

    t_start = time.time()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    eval_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    base, tok = load_model(args.model, dtype=torch.float32, device="cpu")
    log(f"loaded {base.config.model_type} in {time.time() - t_start:.1f}s; device {device}")
    results = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)", "device": device,
               "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor(),
               "torch": torch.__version__, "eval_dtype": str(eval_dtype).replace("torch.", ""),
               "w4a4_backend": args.backend, "wikitext2": {"max_tokens": args.max_tokens}, "rows": []}
    tmp = Path(tempfile.mkdtemp(prefix="qat-bench-"))

    def evaluate(name, model, extra=None):
        t = time.time()
        ppl = wikitext2_perplexity(model, tok, seq_len=args.ppl_seq_len, max_tokens=args.max_tokens,
                                   batch_size=args.ppl_batch_size, progress=False)
        row = {"name": name, "ppl": round(ppl["ppl"], 4), "nll": round(ppl["nll"], 6), "tokens": ppl["tokens"],
               "seq_len": ppl["seq_len"], "eval_seconds": round(time.time() - t, 1), **(extra or {})}
        if args.tasks_limit:
            from nibble.eval.tasks import evaluate_tasks
            tasks = evaluate_tasks(model, tok, limit=args.tasks_limit, progress=False)
            row["tasks"] = {k: v["acc"] for k, v in tasks.items()}
        results["rows"].append(row)
        log(json.dumps(row))
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))

    def deployed(model, name):
        """save_quantized -> load_quantized in the eval dtype: what a user of the checkpoint runs."""
        d = tmp / name
        save_quantized(model, d)
        loaded, _ = load_quantized(d, device=device, dtype=eval_dtype)
        set_backend(loaded, args.backend)
        return loaded

    m16 = copy.deepcopy(base).to(device=device, dtype=eval_dtype)
    evaluate("16-bit", m16)
    del m16

    recipes = [r for r in args.recipes.split(",") if r]
    inits = [i for i in args.inits.split(",") if i]
    calibration = calibration_batches(tok) if "gptq" in inits else None
    if not args.skip_rtn:
        # the W4A4 models the PE-QAT runs start from: RTN's (the gaps are measured from them), GPTQ's for its init
        rotations = {"per-token": "none", "hadamard": "hadamard"}
        baselines = [(f"W4A4 {method.upper()} {'Hadamard' if recipe == 'hadamard' else recipe}", rotations[recipe],
                      method) for method in dict.fromkeys(["rtn", *inits]) for recipe in recipes if recipe in rotations]
        for name, rotation, method in baselines:
            m = copy.deepcopy(base).to(device)
            quantize_model(m, QuantConfig(mode="w4a4", rotation=rotation, method=method), progress=False,
                           calibration=None if method == "rtn" else calibration)  # RTN refuses it
            evaluate(name, deployed(m.cpu(), name.replace(" ", "_")))
            del m

    if args.train_seconds and recipes:
        times = []

        def tick(step, loss):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.time())

        run_qat(copy.deepcopy(base), tok, recipes[-1], 4, args.lr, args.seq_len, args.batch_size, device=device,
                objective=args.objective, gradient_checkpointing=not args.no_gradient_checkpointing,
                progress=False, callback=tick)
        step_s = (times[-1] - times[1]) / (len(times) - 2)  # the first steps include warm-up
        args.steps = max(10, min(args.steps, int(args.train_seconds / step_s)))
        results["probe"] = {"recipe": recipes[-1], "seconds_per_step": round(step_s, 4), "steps": args.steps}
        log(f"probe: {step_s:.3f} s/step -> {args.steps} steps per recipe")

    for recipe, init in [(r, i) for i in inits for r in recipes]:
        quant_lr = args.quant_lr if learns_quantization(recipe) else None  # hadamard learns none: its run warned
        m = copy.deepcopy(base)
        t = time.time()
        qat = run_qat(m, tok, recipe, args.steps, args.lr, args.seq_len, args.batch_size,
                      out_dir=tmp / f"state-{recipe}-{init}", device=device, objective=args.objective,
                      quant_lr=quant_lr, save_every=10**9, init=init, calibration=calibration,
                      gradient_checkpointing=not args.no_gradient_checkpointing,
                      progress=os.environ.get("QAT_PROGRESS", "0") == "1")
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        train_s = time.time() - t
        meta = qat.qat_meta
        qmodel = export(qat)
        name = f"PE-QAT {recipe}" + (" from GPTQ" if init == "gptq" else "")
        evaluate(name, deployed(qmodel.cpu(), f"qat_{recipe}_{init}"),
                 {"recipe": recipe, "init": init, "steps": args.steps, "batch_size": args.batch_size,
                  "train_seq_len": args.seq_len,
                  "train_tokens": meta["tokens_total"], "train_minutes": round(train_s / 60, 2),
                  "objective": args.objective, "lr": args.lr, "quant_lr": quant_lr, "lora_rank": meta["rank"],
                  "gradient_checkpointing": not args.no_gradient_checkpointing,
                  "final_loss": meta.get("final_loss")})
        del qat, qmodel

    rows = {r["name"]: r["ppl"] for r in results["rows"]}
    if "16-bit" in rows and any(k.startswith("W4A4 RTN") for k in rows):
        best_rtn = min(v for k, v in rows.items() if k.startswith("W4A4 RTN"))
        gap = best_rtn - rows["16-bit"]
        results["gap_closed"] = {k: round((best_rtn - v) / gap, 4) for k, v in rows.items()
                                 if k.startswith(("PE-QAT", "W4A4 GPTQ"))}
    results["total_seconds"] = round(time.time() - t_start, 1)
    Path(args.json).write_text(json.dumps(results, indent=2))
    log(json.dumps({k: results[k] for k in ("gap_closed", "total_seconds") if k in results}))


if __name__ == "__main__":
    main()
