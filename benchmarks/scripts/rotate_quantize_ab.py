"""The online Hadamard + per-token quantization of W4A4 for a few rows: the CUDA kernel
(csrc/rotate_quantize.cu, `w4a4.rotate_quantize`: one launch, a row per thread-block cluster)
against the Triton path it replaces (`w4a4.quantize_activations_triton` with input_hadamard=True:
for a few rows the row-splitting transform, then the plain quantization), in one process.

Kernel level: CUDA-graph timing of each, inputs of every M x K, codes compared with the float32
spec (flips). Model level: W4A4 + Hadamard (`w4a4-hadamard`) prefill and decode of random-weight
models, one engine per arm, the Triton arm's graphs captured with `rotate_quantize_applicable`
switched off, alternating rounds, greedy tokens compared; and each arm's codes against the float32
spec on the model's own down_proj inputs (`spec_agreement`: a flipped code can change a greedy token).

    PYTHONPATH=. python3 benchmarks/scripts/rotate_quantize_ab.py --json $OUT/rq.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import bench_us, env_meta, shape_list  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.eval.engine import Engine  # noqa: E402
from nibble.eval.report import quant_config  # noqa: E402
from nibble.kernels import reference, w4a4  # noqa: E402
from nibble.kernels.hadamard import hadamard_transform_reference  # noqa: E402

APPLICABLE = w4a4.rotate_quantize_applicable
# Random-weight models: nibble.eval.speed's (MLPs of 11008 = 172 x 64 and 14336 = 28 x 512), and a
# Qwen2-7B-shaped Llama (its MLP is 18944 = 148 x 128 wide).
MODELS = {"llama-2-7b": ("llama-2-7b", {}), "llama-3-8b": ("llama-3-8b", {}),
          "qwen2-7b-shaped": ("llama-2-7b", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064))}


def use_cuda_kernel(on: bool) -> None:
    w4a4.rotate_quantize_applicable = APPLICABLE if on else (lambda x: False)


class Arm:
    """An engine whose calls run under ``use(setting)``, then ``use(default)`` again (graphs capture
    what runs): here the CUDA kernel on or off."""

    def __init__(self, engine: Engine, setting, use=use_cuda_kernel, default=True):
        self.engine, self.setting, self.use, self.default = engine, setting, use, default

    def __getattr__(self, name):
        attr = getattr(self.engine, name)
        if not inspect.ismethod(attr):
            return attr

        def call(*args, **kwargs):
            self.use(self.setting)
            try:
                return attr(*args, **kwargs)
            finally:
                self.use(self.default)
        return call


def kernel_rows(ks, ms, rounds):
    rows = []
    for K in ks:
        for M in ms:
            x = (torch.randn(M, K, device="cuda") * torch.logspace(-1, 1, K, device="cuda")).to(torch.bfloat16)
            if not APPLICABLE(x):
                continue
            q, s = w4a4.rotate_quantize(x)
            qt, st = w4a4.quantize_activations_triton(x, True)
            row = dict(K=K, M=M)
            qr, sr = reference.quantize_activations(hadamard_transform_reference(x))
            row["cuda_flips"] = int((q != qr).sum())
            row["triton_flips"] = int((qt != qr).sum())
            fns = {"cuda": lambda: w4a4.rotate_quantize(x), "triton": lambda: w4a4.quantize_activations_triton(x, True)}
            times = {name: [] for name in fns}
            for r in range(rounds):
                for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                    times[name].append(bench_us(lambda i, f=fns[name]: f, 1, warmup_ms=10, reps=20))
            for name in fns:
                row[f"{name}_us"] = round(statistics.median(times[name]), 3)
            row["speedup"] = round(row["triton_us"] / row["cuda_us"], 3)
            print(row, flush=True)
            rows.append(row)
    return rows


def spec_agreement(model, model_name, tokens=16):
    """Codes of each arm against the float32 spec on the model's own rotated inputs (every down_proj's,
    from one forward of `tokens` tokens): random-weight models sit near ties, so a single flipped code
    can change a greedy token, and the arms' tokens are compared with this in view."""
    inputs = []
    hooks = [layer.mlp.down_proj.register_forward_hook(
        lambda mod, args, out: inputs.append(args[0].detach().reshape(-1, args[0].shape[-1]).clone()))
        for layer in model.model.layers]
    prompt = torch.randint(1, 1000, (1, tokens), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        model(prompt)
    for h in hooks:
        h.remove()
    flips = {"cuda": 0, "triton": 0}
    for x in inputs:
        qr, sr = reference.quantize_activations(hadamard_transform_reference(x))
        for name, (q, s) in (("cuda", w4a4.rotate_quantize(x)), ("triton", w4a4.quantize_activations_triton(x, True))):
            flips[name] += int((q != qr).sum()) + int((s != sr).sum())
    return dict(model=model_name, phase="spec", rows=tokens, layers=len(inputs), codes=sum(x.numel() for x in inputs),
                cuda_flips=flips["cuda"], triton_flips=flips["triton"])


def model_rows(models, batches, prefills, rounds):
    rows = []
    for model_name in models:
        base, overrides = MODELS[model_name]
        model = speed.random_model(base, **overrides)
        speed.quantize_in_place(model, quant_config("w4a4-hadamard", model, clip_search=False))
        rows.append(spec_agreement(model, model_name))
        print(rows[-1], flush=True)
        for batch in batches:
            engines = {name: Arm(Engine(model, max_batch=batch, max_seq_len=512 + 160), cuda)
                       for name, cuda in (("cuda", True), ("triton", False))}
            prompt = torch.randint(1, 1000, (batch, 16), generator=torch.Generator().manual_seed(0)).cuda()
            tokens = {name: e.generate(prompt, 12).tolist() for name, e in engines.items()}
            times = speed.alternating_decodes(engines, batch, 128, 128, rounds)
            for name in engines:
                ms = statistics.median(times[name])
                rows.append(dict(model=model_name, phase="decode", batch=batch, arm=name, ms=round(ms, 4),
                                 rounds=times[name], same_tokens=tokens[name] == tokens["cuda"]))
                print(rows[-1], flush=True)
            shapes = [(b, t) for b, t in prefills if b == batch]
            if shapes:
                pt = speed.alternating_prefills(engines, shapes, rounds)
                for (name, shape), ts in pt.items():
                    rows.append(dict(model=model_name, phase="prefill", batch=shape[0], T=shape[1], arm=name,
                                     ms=round(statistics.median(ts), 4), rounds=ts))
                    print(rows[-1], flush=True)
            speed.release(*(a.engine for a in engines.values()))
        speed.release(model)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", default="576,1536,4096,11008,14336,18944,28672",
                    help="row sizes; those the kernel does not take are skipped")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prefills", default="", help="e.g. 1x128,8x512 (the kernel runs up to 16 rows only)")
    ap.add_argument("--rounds", type=int, default=4, help="even: each arm runs first as often")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    speed.require_cuda("rotate_quantize_ab")
    rows = kernel_rows([int(k) for k in args.ks.split(",")], [int(m) for m in args.ms.split(",")], 2)
    prefills = shape_list(args.prefills) if args.prefills else []
    rows += model_rows(args.models, [int(b) for b in args.batches.split(",")], prefills, args.rounds)
    if args.json:
        args.json.write_text(json.dumps(dict(meta=env_meta(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
