"""End-to-end speed: prefill latency and decode tokens/s through the engine, with their rooflines.

Every number comes with the figure that says how good it is:

- decode: tokens/s and the GB/s at which the step streams its weights (and, with the KV cache,
  everything it reads), next to the device's measured copy bandwidth;
- prefill: milliseconds and the TFLOP/s achieved (2 x weights x tokens, plus attention), next to
  the device's measured bf16 matmul rate.

Timing: CUDA events around CUDA-graph replays, after warm-up; the median of several repeats.
The speed models (`nibble.eval.SPEED_MODELS`) are random-weight Llama-2-7B-, Llama-3-8B-, Llama-3.2-1B-,
Qwen2.5-7B- and Qwen3-8B-shaped models built directly on the GPU in bf16 (speed does not depend on the values) and
quantized in place, layer by layer, so two copies of the weights never sit on the GPU together.
"""
from __future__ import annotations

import gc
import statistics
import time

import torch
from torch import nn

from nibble.bench.timing import capture_graph
from nibble.config import QuantConfig
from nibble.eval import SPEED_MODELS
from nibble.eval.engine import GREEDY, Engine, Sampling
from nibble.eval.memory import decode_stream_bytes, linear_bytes, weight_memory

PREFILL_SHAPES = ((1, 128), (1, 512), (8, 128), (8, 512))  # (batch, prompt tokens)
DECODE_BATCHES = (1, 8)

_CEILINGS: dict = {}


def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA GPU and none is visible (speed and memory are measured on "
                           "the GPU only; the accuracy part of the report runs on the CPU)")


def _median_ms(fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def device_ceilings() -> dict:
    """Measured once per process: device-to-device copy GB/s (bytes read + written) and bf16 matmul TFLOP/s."""
    require_cuda("device_ceilings")
    if not _CEILINGS:
        src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").fill_(1)
        dst = torch.empty_like(src)
        ms = _median_ms(lambda: dst.copy_(src), reps=10, warmup=3)
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        mm_ms = _median_ms(lambda: a @ b, reps=10, warmup=3)
        _CEILINGS.update(copy_gbps=2 * src.numel() / ms / 1e6, bf16_tflops=2 * 8192 ** 3 / mm_ms / 1e9,
                         gpu=torch.cuda.get_device_name())
        del src, dst, a, b
        torch.cuda.empty_cache()
    return dict(_CEILINGS)


# ---- the speed models ------------------------------------------------------------------------
def random_model(name: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, **overrides) -> nn.Module:
    """A random-weight model of the shape ``SPEED_MODELS[name]``, built on ``device`` directly in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in SPEED_MODELS:
        raise ValueError(f"unknown speed model {name!r}; choose from {list(SPEED_MODELS)}")
    shape = {"model_type": "llama", **SPEED_MODELS[name], "tie_word_embeddings": False, **overrides}
    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def quantize_in_place(model: nn.Module, config: QuantConfig | None, calibration=None, progress: bool = False) -> float:
    """Quantize ``model`` (layer by layer, each 16-bit weight freed as its QuantLinear replaces it; GPTQ / AWQ
    calibrated on ``calibration``; ``progress``: `quantize_model`'s bar of layers on stderr); seconds taken."""
    from nibble.models.convert import quantize_model

    t0 = time.perf_counter()
    if config is not None:
        quantize_model(model, config, progress=progress, calibration=calibration)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def release(*objs) -> None:
    """Close these engines and give the memory of everything dropped back to the driver, cuBLAS's
    per-stream workspaces included (the next measurement's peak must not count them)."""
    for o in objs:
        if isinstance(o, Engine):
            o.close()
    gc.collect()
    if torch.cuda.is_available():
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            torch.cuda.synchronize()
            clear_workspaces()
        torch.cuda.empty_cache()


# ---- measurements ----------------------------------------------------------------------------
def linear_flops_per_token(model: nn.Module) -> int:
    """2 x the weights of the decoder linears: the matmul FLOPs per token (lm_head is counted apart)."""
    cfg = model.config
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    attn = h * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    return 2 * (L * (attn + 3 * h * i))


def prefill_flops(model: nn.Module, batch: int, T: int) -> int:
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = 2 * 2 * cfg.num_attention_heads * hd * (T * (T + 1) // 2) * cfg.num_hidden_layers  # QK^T and PV, causal
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size  # last token only
    return batch * (T * linear_flops_per_token(model) + attention + lm_head)


def measure_prefill(engine: Engine, batch: int, T: int, reps: int = 10, warmup: int = 3, seed: int = 0) -> float:
    """Median milliseconds of one prefill of ``batch`` x ``T`` tokens (graph replay when on CUDA)."""
    vocab = engine.embed.weight.shape[0]
    prompt = torch.randint(0, vocab, (batch, T), generator=torch.Generator().manual_seed(seed)).to(engine.device)

    @torch.inference_mode()
    def prefill():  # the model's prefill: `Engine.prefill`'s check of the ids (a host sync) is the caller's
        engine._prefill(prompt, [T] * batch, GREEDY)

    return _median_ms(prefill, reps, warmup)


def alternating_prefills(engines: dict, shapes, rounds: int, say=None) -> dict:
    """{(name, (batch, T)): [ms, one per round]}: `measure_prefill` of every engine of ``engines``
    ({name: Engine}) at every prompt shape, in rounds whose engine order alternates (as given, then
    reversed), so that no engine always runs first: an A/B of engines in one process.
    ``say(round, times)`` is called after each round."""
    times = {(name, shape): [] for name in engines for shape in shapes}
    for r in range(rounds):
        names = round_order(engines, r)
        for shape in shapes:
            for name in names:
                times[name, shape].append(measure_prefill(engines[name], *shape))
        if say is not None:
            say(r, times)
    return times


def round_order(names, r: int) -> list:
    """``names`` (or a dict's keys) in round ``r`` of an A/B: as given, then reversed, so none always runs first."""
    return list(names) if r % 2 == 0 else list(reversed(list(names)))


def measure_decode(engine: Engine, batch: int, prompt_len: int, tokens: int, reps: int = 3, seed: int = 0,
                   sampling: Sampling = GREEDY) -> float:
    """Median milliseconds of one decode step, over ``reps`` runs of ``tokens`` steps after a ``prompt_len`` prefill,
    each step's token picked by ``sampling`` (greedy by default)."""
    vocab = engine.embed.weight.shape[0]
    prompt = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(seed)).to(engine.device)
    engine.prefill(prompt, sampling)
    engine.decode(2, collect=False)  # captures the decode graph
    times = []
    for _ in range(reps):
        engine.prefill(prompt, sampling)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        engine.decode(tokens, collect=False)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / tokens)
    return statistics.median(times)


def alternating_decodes(engines: dict, batch: int, prompt_len: int, tokens: int, rounds: int,
                        reps: int = 3) -> dict:
    """{name: [ms per step, one per round]}: `measure_decode` of every engine of ``engines`` ({name:
    Engine}) in rounds whose order alternates as `alternating_prefills`' does."""
    times = {name: [] for name in engines}
    for r in range(rounds):
        for name in round_order(engines, r):
            times[name].append(measure_decode(engines[name], batch, prompt_len, tokens, reps=reps))
    return times


def measure_decode_linears(engine: Engine, batch: int, reps: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of the matmuls alone of one decode step (every linear of every layer + lm_head),
    replayed as one CUDA graph: the step time minus this is the engine's glue (norms, RoPE, attention)."""
    cfg = engine.model.config
    g = torch.Generator(device=engine.device).manual_seed(0)

    def rand(n):
        return torch.randn(batch, 1, n, dtype=engine.dtype, device=engine.device, generator=g)
    h, attn_out, mid = rand(cfg.hidden_size), rand(engine.n_heads * engine.head_dim), rand(cfg.intermediate_size)

    def body():
        for layer in engine.layers:
            a, m = layer.self_attn, layer.mlp
            a.q_proj(h), a.k_proj(h), a.v_proj(h), a.o_proj(attn_out)
            m.gate_proj(h), m.up_proj(h), m.down_proj(mid)
        engine.lm_head(h[:, -1])
    with torch.inference_mode():
        graph, _ = capture_graph(body, engine.device)
        ms = _median_ms(graph.replay, reps, warmup)
    del graph
    return ms


def speed_benchmark(model: nn.Module, label: str, prefill_shapes=PREFILL_SHAPES, decode_batches=DECODE_BATCHES,
                    decode_prompt: int = 128, decode_tokens: int = 128, log=print) -> list[dict]:
    """Prefill and decode rows for ``model`` (already on the GPU, quantized or not), each with its roofline."""
    require_cuda("speed_benchmark")
    ceil = device_ceilings()
    mem = weight_memory(model)
    stream = decode_stream_bytes(mem)
    max_batch = max([b for b, _ in prefill_shapes] + list(decode_batches))
    max_len = max([t for _, t in prefill_shapes] + [decode_prompt]) + decode_tokens
    engine = Engine(model, max_batch=max_batch, max_seq_len=max_len)
    rows = []
    try:
        for b, t in prefill_shapes:
            ms = measure_prefill(engine, b, t)
            tflops = prefill_flops(model, b, t) / ms / 1e9
            rows.append(dict(model=label, phase="prefill", batch=b, tokens=t, ms=ms, tflops=tflops,
                             pct_bf16_peak=100 * tflops / ceil["bf16_tflops"]))
            log(f"  {label:28s} prefill b={b} T={t:4d}: {ms:8.2f} ms  {tflops:6.1f} TFLOP/s "
                f"({rows[-1]['pct_bf16_peak']:.0f}% of bf16 matmul {ceil['bf16_tflops']:.0f})")
        for b in decode_batches:
            ms = measure_decode(engine, b, decode_prompt, decode_tokens)
            lin = measure_decode_linears(engine, b)
            kv = 2 * engine.k_cache[:, :b].numel() * engine.k_cache.element_size()  # the step reads the whole cache
            gbps = stream / ms / 1e6
            rows.append(dict(model=label, phase="decode", batch=b, tokens=decode_tokens, prompt=decode_prompt,
                             ms_per_step=ms, tokens_per_s=1000 * b / ms, weight_gbps=gbps,
                             total_gbps=(stream + kv) / ms / 1e6, pct_copy_roofline=100 * gbps / ceil["copy_gbps"],
                             linears_ms=lin, linears_gbps=stream / lin / 1e6, glue_ms=ms - lin,
                             weight_stream_bytes=stream, kv_read_bytes=kv))
            log(f"  {label:28s} decode  b={b}: {ms:6.3f} ms/step {rows[-1]['tokens_per_s']:8.1f} tok/s  "
                f"weights {gbps:6.0f} GB/s, +KV {rows[-1]['total_gbps']:6.0f} GB/s "
                f"({rows[-1]['pct_copy_roofline']:.0f}% of copy {ceil['copy_gbps']:.0f} GB/s); "
                f"matmuls alone {lin:.3f} ms = {stream / lin / 1e6:.0f} GB/s, the rest {ms - lin:.3f} ms")
    finally:
        release(engine)
    for r in rows:
        r.update(weight_bytes=mem["total_bytes"], linear_bytes=linear_bytes(mem))
    return rows

