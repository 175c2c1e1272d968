"""Quantizing a model the GPU cannot hold in 16 bits: `quantize_model(..., device="cuda")` on a model in host
memory, against the same model moved to the GPU whole first. Peak GPU memory, seconds, and both ways' results
compared bit for bit; then the host-quantized model decodes in nibble's engine. JSON out.

    PYTHONPATH=. python3 benchmarks/scripts/quantize_from_host.py --json quantize-from-host-h200.json

Random bf16 weights in the shapes of `nibble.eval.speed.SPEED_MODELS` (built on the GPU, then moved to host
memory: memory and time do not depend on the values). Each row: a model, a config, a way ("whole": moved to the
GPU, then quantized there; "from host": quantized from host memory, one decoder layer at a time), the seconds
from the call (or the move) to the last QuantLinear, the peak of `torch.cuda.max_memory_allocated` over that
span, and what the quantized model holds after. GPTQ (`--configs w4a16-gptq`) calibrates on 64 x 2,048 uniformly
random ids (`gptq_7b.py` without the tokenizer); `--layers N` keeps the first N decoder layers (a quicker GPTQ).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.config import QuantConfig  # noqa: E402
from nibble.eval.engine import Engine  # noqa: E402
from nibble.eval.memory import peak_memory  # noqa: E402
from nibble.eval.speed import measure_decode, random_model, release  # noqa: E402
from nibble.models.convert import quantize_model  # noqa: E402

GIB = 2 ** 30
CONFIGS = {"w4a16": dict(mode="w4a16", group_size=128), "w4a4-hadamard": dict(mode="w4a4", rotation="hadamard"),
           "w4a16-gptq": dict(mode="w4a16", group_size=128, method="gptq")}


def host_model(name: str, layers: int | None) -> torch.nn.Module:
    torch.manual_seed(0)
    overrides = {} if layers is None else dict(num_hidden_layers=layers)
    model = random_model(name, "cuda", **overrides).to("cpu")  # built where initialization is fast
    release()
    return model


def measure(model, config: str, way: str, calibration=None) -> tuple[torch.nn.Module, dict]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    if way == "whole":
        model.to("cuda")
        quantize_model(model, QuantConfig(**CONFIGS[config]), progress=False, calibration=calibration)
    else:
        quantize_model(model, QuantConfig(**CONFIGS[config]), progress=False, calibration=calibration, device="cuda")
    torch.cuda.synchronize()
    row = dict(config=config, way=way, seconds=round(time.perf_counter() - t0, 2),
               peak_gib=round((torch.cuda.max_memory_allocated() - base) / GIB, 3),
               after_gib=round((torch.cuda.memory_allocated() - base) / GIB, 3))
    print(json.dumps(row), flush=True)
    return model, row


def same_state(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def decode_check(model, prompt_len: int = 128, new_tokens: int = 128) -> dict:
    """The host-quantized model in nibble's engine, as the report measures it: decode tokens/s at batch 1
    (`speed.measure_decode`) and the GPU peak of a prefill + decode (`memory.peak_memory`)."""
    engine = Engine(model, max_batch=1, max_seq_len=prompt_len + new_tokens)
    step_ms = measure_decode(engine, 1, prompt_len, new_tokens)
    release(engine)
    peak = peak_memory(model, prompt_len, new_tokens)["peak_bytes"]
    return dict(decode_tokens_per_s=round(1000 / step_ms, 1), peak_gib_with_engine=round(peak / GIB, 3))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama-2-7b", "llama-3-8b"])
    ap.add_argument("--configs", nargs="+", default=["w4a16", "w4a4-hadamard"], choices=list(CONFIGS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=[])
    for name in args.models:
        for config in args.configs:
            host = host_model(name, args.layers)
            bf16_gib = sum(p.numel() * p.element_size() for p in host.parameters()) / GIB
            calib = torch.randint(0, host.config.vocab_size, (64, 2048), generator=torch.Generator().manual_seed(0)) \
                if "gptq" in config else None
            whole, row_whole = measure(copy.deepcopy(host), config, "whole", calib)
            quantized, row_host = measure(host, config, "from host", calib)
            equal = same_state(whole, quantized)
            del whole
            release()
            extra = decode_check(quantized) if config == "w4a16" else {}
            for row in (row_whole, row_host):
                result["rows"].append(dict(model=name, layers=host.config.num_hidden_layers,
                                           bf16_model_gib=round(bf16_gib, 3), **row, equal_to_whole=equal,
                                           **(extra if row is row_host else {})))
            print(json.dumps(result["rows"][-1]), flush=True)
            del quantized
            release()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
