"""Where a model's bytes go: weights by module kind, and the peak CUDA memory of a generation.

``weight_memory(model)`` walks the state dict (tied tensors counted once, so the kinds add up to
exactly the bytes a checkpoint of the model holds) and files every tensor under one kind:

| kind | what |
|---|---|
| embeddings | the input token embedding table |
| attention | q/k/v/o projections (and their biases) |
| mlp | gate/up/down projections |
| lm_head | the output projection (0 bytes when it is tied to the embeddings) |
| norms | RMSNorm weights (Qwen3's per-head q / k norms inside attention too) |
| other | anything else |

Each kind splits into ``quantized_bytes`` (INT4 codes, scales and zeros of ``QuantLinear``) and
``dense_bytes`` (16/32-bit tensors). ``peak_memory`` runs a 512-token prefill and a 128-token
decode through the engine (static KV cache, CUDA graphs) and reports the allocator's peak.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from nibble.nn.quant_linear import QuantLinear

KINDS = ("embeddings", "attention", "mlp", "lm_head", "norms", "other")
LINEAR_KINDS = ("attention", "mlp")  # the decoder-layer linears: what quantization shrinks
_QUANT_BUFFERS = ("qweight", "scales", "zeros")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _kind(module_name: str, module: nn.Module, embedding: nn.Module, lm_head: nn.Module) -> str:
    leaf = module_name.rsplit(".", 1)[-1]
    if module is embedding:
        return "embeddings"
    if module is lm_head:
        return "lm_head"
    if "norm" in type(module).__name__.lower() or "norm" in leaf:  # Qwen3's q_norm / k_norm inside self_attn too
        return "norms"
    if leaf in _ATTENTION or ".self_attn." in f".{module_name}.":
        return "attention"
    if leaf in _MLP or ".mlp." in f".{module_name}.":
        return "mlp"
    return "other"


def weight_memory(model: nn.Module) -> dict:
    """Bytes of the model's state dict by kind: ``{"kinds": {kind: {bytes, quantized_bytes, dense_bytes}},
    "total_bytes", "quantized_bytes", "dense_bytes", "tied_lm_head"}``."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    modules = dict(model.named_modules())
    kinds = {k: {"bytes": 0, "quantized_bytes": 0, "dense_bytes": 0} for k in KINDS}
    seen = set()
    tied = False
    for name, t in model.state_dict(keep_vars=True).items():
        module_name, _, tensor_name = name.rpartition(".")
        module = modules.get(module_name)
        # a meta tensor (`quantized_structure`'s) has no data pointer (0 for all): a tied one is the same Parameter
        key = (id(t) if t.is_meta else t.data_ptr(), t.dtype, tuple(t.shape), t.device)
        if t.numel() and key in seen:  # tied weights: lm_head.weight is embed_tokens.weight
            tied = tied or module is lm_head
            continue
        seen.add(key)
        kind = _kind(module_name, module, embedding, lm_head)
        n = t.numel() * t.element_size()
        part = "quantized_bytes" if isinstance(module, QuantLinear) and tensor_name in _QUANT_BUFFERS else "dense_bytes"
        kinds[kind]["bytes"] += n
        kinds[kind][part] += n
    return {
        "kinds": kinds,
        "total_bytes": sum(k["bytes"] for k in kinds.values()),
        "quantized_bytes": sum(k["quantized_bytes"] for k in kinds.values()),
        "dense_bytes": sum(k["dense_bytes"] for k in kinds.values()),
        "tied_lm_head": tied,
    }


def linear_bytes(mem: dict) -> int:
    """Bytes of the decoder-layer linears (`LINEAR_KINDS`): what quantization shrinks."""
    return sum(mem["kinds"][kind]["bytes"] for kind in LINEAR_KINDS)


def decode_stream_bytes(mem: dict) -> int:
    """Weight bytes one decode step must read: everything but the embedding table, of which a step
    reads only the rows of its tokens (unless the table is also the lm_head)."""
    table = 0 if mem["tied_lm_head"] else mem["kinds"]["embeddings"]["bytes"]
    return mem["total_bytes"] - table


def peak_memory(model: nn.Module, prompt_len: int = 512, decode_tokens: int = 128, batch: int = 1,
                cuda_graphs: bool = True, seed: int = 0) -> dict:
    """Peak CUDA memory of a ``prompt_len`` prefill + ``decode_tokens`` greedy decode (engine, static cache).

    The allocator's peak is reset after the model is on the GPU, so ``peak_bytes`` covers weights,
    KV cache, activations and graph pools; ``weights_bytes`` is what the allocator held before.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("peak_memory measures CUDA memory: it needs a CUDA GPU and none is visible")
    from nibble.eval.engine import Engine

    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"the model is on {device}: move it to the GPU first (model.to('cuda'))")
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    engine = Engine(model, max_batch=batch, max_seq_len=prompt_len + decode_tokens, cuda_graphs=cuda_graphs)
    kv = engine.kv_cache_bytes()
    engine.generate(prompt.to(device), decode_tokens)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    engine.close()
    del engine
    torch.cuda.empty_cache()
    return {"weights_bytes": before, "peak_bytes": peak, "kv_cache_bytes": kv, "prompt_len": prompt_len,
            "decode_tokens": decode_tokens, "batch": batch, "cuda_graphs": cuda_graphs}


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def memory_bound(device: torch.device) -> tuple[int, str] | None:
    """(bytes, what they are) that an allocation on ``device`` cannot usefully exceed: on CUDA the device's free
    memory with what PyTorch's allocator holds unused, on the CPU the machine's physical memory as os.sysconf says
    it (past it, swap at best). One below the bound may still fail; None where no bound is reliable (another
    device, a system without sysconf)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free, f"the {format_bytes(free)} free on {device}"
    if device.type == "cpu" and hasattr(os, "sysconf"):  # not on Windows
        try:
            physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):  # a name this system does not know
            return None
        if physical > 0:  # -1: unknown
            return physical, f"this machine's {format_bytes(physical)} of memory"
    return None
