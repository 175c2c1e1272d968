"""Memory accounting, the decode engine and the speed helpers.

CPU tests run the engine eagerly (the same forward the CUDA graphs capture); GPU tests (skipped
without CUDA) check graph-captured greedy tokens against ``model.generate`` for bf16 and W4A16.
"""
import math
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import past_stop, poison_new_tensors, tiny_model
from nibble import QuantConfig, QuantLinear, quantize_model
from nibble.bench import timing
from nibble.eval import engine as engine_mod
from nibble.eval import memory, report, speed
from nibble.eval.engine import Engine
from nibble.kernels import w4a4
from nibble.models.convert import weight_bytes

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def unique_state_dict_bytes(model) -> int:
    seen, total = set(), 0
    for t in model.state_dict().values():
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def hf_greedy(model, prompt, n):
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, prompt.shape[1]:]


# ---- memory ----------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("mode", [None, "w4a16", "w4a4"])
def test_weight_kinds_add_up_to_the_state_dict_bytes(tied, mode):
    model = tiny_model(tie_word_embeddings=tied)
    if mode:
        quantize_model(model, QuantConfig(mode=mode, group_size=32 if mode == "w4a16" else None), progress=False)
    mem = memory.weight_memory(model)

    assert mem["total_bytes"] == unique_state_dict_bytes(model)
    assert sum(k["bytes"] for k in mem["kinds"].values()) == mem["total_bytes"]
    assert mem["quantized_bytes"] + mem["dense_bytes"] == mem["total_bytes"]
    assert mem["tied_lm_head"] == tied
    k = mem["kinds"]
    h, v = model.config.hidden_size, model.config.vocab_size
    assert k["embeddings"]["bytes"] == v * h * 4
    assert k["lm_head"]["bytes"] == (0 if tied else v * h * 4)
    assert k["norms"]["bytes"] == (2 * 2 + 1) * h * 4  # two per layer + the final norm, float32
    assert k["other"]["bytes"] == 0
    if mode:
        # the quantized part is exactly QuantLinear's codes + scales + zeros, all in attention and MLP
        assert mem["quantized_bytes"] == weight_bytes(model)["quantized_bytes"]
        assert k["attention"]["quantized_bytes"] + k["mlp"]["quantized_bytes"] == mem["quantized_bytes"]
        assert k["embeddings"]["quantized_bytes"] == k["lm_head"]["quantized_bytes"] == 0


def test_a_quantized_lm_head_is_filed_under_lm_head():
    model = tiny_model()  # tied: quantizing lm_head unties it, the embedding keeps its float table
    quantize_model(model, QuantConfig(mode="w4a16", group_size=32, modules_to_not_convert=[]), progress=False)
    mem = memory.weight_memory(model)
    h, v = model.config.hidden_size, model.config.vocab_size
    assert not mem["tied_lm_head"] and mem["kinds"]["embeddings"]["bytes"] == v * h * 4
    assert mem["kinds"]["lm_head"]["quantized_bytes"] == v * h // 2 + 2 * (v * h // 32) * 2  # codes + fp16 scales, zeros
    assert mem["quantized_bytes"] == weight_bytes(model)["quantized_bytes"]


def test_quantized_linears_take_about_a_quarter_of_16_bit_plus_scales():
    dense = tiny_model(dtype=torch.bfloat16)
    q = tiny_model(dtype=torch.bfloat16)
    quantize_model(q, QuantConfig(mode="w4a16", group_size=64), progress=False)
    ratio = memory.linear_bytes(memory.weight_memory(q)) / memory.linear_bytes(memory.weight_memory(dense))
    assert ratio == pytest.approx(0.25 + 2 * 2 / (64 * 2), rel=1e-6)  # 4 bits + fp16 scale and zero per 64


def test_linear_bytes_are_the_decoder_layers_linears_without_an_untied_lm_head():
    """What quantization shrinks: q/k/v/o and gate/up/down of every layer; an untied lm_head (kept 16-bit by default)
    is not among them."""
    model = tiny_model(tie_word_embeddings=False)
    mem = memory.weight_memory(model)
    layers = sum(m.weight.numel() * 4 for m in model.model.layers.modules() if isinstance(m, nn.Linear))
    assert memory.linear_bytes(mem) == layers and mem["kinds"]["lm_head"]["bytes"] > 0


def test_decode_stream_bytes_skip_the_embedding_table_unless_it_is_the_lm_head():
    for tied in (True, False):
        mem = memory.weight_memory(tiny_model(tie_word_embeddings=tied))
        table = mem["kinds"]["embeddings"]["bytes"]
        assert memory.decode_stream_bytes(mem) == mem["total_bytes"] - (0 if tied else table)


def test_a_quantized_layers_bias_is_dense_bytes():
    """Qwen2's q/k/v biases stay 16/32-bit tensors in a QuantLinear: filed as dense, not with its codes, scales and
    zeros (the Llama models above have no bias)."""
    model = tiny_model("qwen2")
    quantize_model(model, QuantConfig(mode="w4a16", group_size=32), progress=False)
    attention = memory.weight_memory(model)["kinds"]["attention"]
    linears = [m for m in model.model.layers.modules() if isinstance(m, QuantLinear) and m.bias is not None]
    assert linears  # q, k and v of each layer
    biases = sum(m.bias.numel() * m.bias.element_size() for m in linears)
    codes = sum(t.numel() * t.element_size() for name, m in model.named_modules() if ".self_attn." in name
                and isinstance(m, QuantLinear) for t in (m.qweight, m.scales, m.zeros))
    assert (attention["quantized_bytes"], attention["dense_bytes"]) == (codes, biases)


def test_only_a_quantlinears_codes_scales_and_zeros_are_quantized_bytes():
    """A dense module's own tensors of those names (a learned per-channel "scales") are dense bytes."""
    model = tiny_model()
    model.model.layers[0].mlp.scales = nn.Parameter(torch.ones(64))
    mem = memory.weight_memory(model)
    assert mem["quantized_bytes"] == 0 and mem["kinds"]["mlp"]["dense_bytes"] == mem["kinds"]["mlp"]["bytes"]


def test_fused_projections_and_norms_of_other_names_are_filed_by_what_they_are():
    """By the block a projection sits in (Phi-3's qkv_proj and gate_up_proj), and by the class of a norm (GPT-2's
    ln_1, ln_2, ln_f), wherever it sits (Qwen3's): not under "other", nor with the linears."""
    from transformers import AutoModelForCausalLM, GPT2Config, Phi3Config

    phi3 = AutoModelForCausalLM.from_config(Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=1, num_attention_heads=2, pad_token_id=0))
    kinds = memory.weight_memory(phi3)["kinds"]
    assert kinds["attention"]["bytes"] == (3 * 32 + 32) * 32 * 4 and kinds["mlp"]["bytes"] == 3 * 64 * 32 * 4
    assert kinds["other"]["bytes"] == 0
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16))
    assert memory.weight_memory(gpt2)["kinds"]["norms"]["bytes"] == 3 * 2 * 32 * 4  # weight and bias each
    qwen3 = tiny_model("qwen3")  # q_norm and k_norm sit in self_attn: norms, not the attention linears quantization shrinks
    kinds, h, d = memory.weight_memory(qwen3)["kinds"], qwen3.config.hidden_size, qwen3.config.head_dim
    assert kinds["norms"]["bytes"] == (2 * 2 + 1) * h * 4 + 2 * 2 * d * 4
    assert kinds["attention"]["bytes"] == 2 * (2 * 4 * d * h + 2 * 2 * d * h) * 4  # q/o: 4 heads, k/v: 2


def test_a_model_built_on_the_meta_device_has_the_weight_memory_of_its_loaded_self():
    """Meta tensors have no data pointer (0 for all): keyed by it, tensors of one shape and dtype counted once."""
    for tied in (True, False):
        with torch.device("meta"):
            empty = tiny_model(tie_word_embeddings=tied)
        assert memory.weight_memory(empty) == memory.weight_memory(tiny_model(tie_word_embeddings=tied))


def test_weights_shared_elsewhere_than_the_lm_head_are_counted_once_and_leave_it_untied():
    model = tiny_model(tie_word_embeddings=False)
    before = memory.weight_memory(model)
    model.model.layers[1].input_layernorm.weight = model.model.layers[0].input_layernorm.weight
    mem = memory.weight_memory(model)
    assert not mem["tied_lm_head"] and mem["total_bytes"] == before["total_bytes"] - 64 * 4


def test_projections_and_norms_are_filed_by_their_own_names_in_blocks_of_other_names():
    """A q_proj or gate_proj is attention or MLP by its name alone, in a block not called self_attn or mlp (the
    tests above have them only there); a norm by its name alone, of a class not called *Norm*."""

    class Scale(nn.Module):  # a norm's weight, of a class whose name says nothing
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

    block = nn.Module()
    block.attn, block.ffn = nn.Module(), nn.Module()
    block.attn.q_proj, block.attn.o_proj = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
    block.ffn.gate_proj, block.ffn.down_proj = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)
    block.post_norm, block.gate = Scale(), nn.Linear(8, 1, bias=False)
    kinds = memory.weight_memory(nn.ModuleDict({"block": block}))["kinds"]
    assert {k: v["bytes"] for k, v in kinds.items()} == {
        "embeddings": 0, "attention": 2 * 8 * 8 * 4, "mlp": 2 * 8 * 16 * 4, "lm_head": 0, "norms": 8 * 4,
        "other": 8 * 4}


def test_format_bytes_changes_unit_at_1024_either_sign():
    assert [memory.format_bytes(n) for n in (1023, 1024, -2048, 3 * 2 ** 30)] == [
        "1023 B", "1.00 KiB", "-2.00 KiB", "3.00 GiB"]


def test_the_cpus_memory_bound_is_its_pages_times_the_page_size(monkeypatch):
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 3 * 2 ** 18}[name])
    assert memory.memory_bound(torch.device("cpu")) == (3 * 2 ** 30, "this machine's 3.00 GiB of memory")


def test_a_sysconf_that_fails_with_an_os_error_gives_no_bound(monkeypatch):
    def failing(name):
        raise OSError("sysconf failed")
    monkeypatch.setattr(os, "sysconf", failing)
    assert memory.memory_bound(torch.device("cpu")) is None


def test_memory_bound_is_none_where_the_machine_does_not_say(monkeypatch):
    """No bound for a device of no memory (meta), nor where sysconf answers -1 (unknown) or does not know the name:
    a bound of -1 bytes refused every KV cache."""
    assert memory.memory_bound(torch.device("meta")) is None
    monkeypatch.setattr(os, "sysconf", lambda name: -1 if name == "SC_PHYS_PAGES" else 4096)
    assert memory.memory_bound(torch.device("cpu")) is None

    def unknown(name):
        raise ValueError("unrecognized configuration name")
    monkeypatch.setattr(os, "sysconf", unknown)
    assert memory.memory_bound(torch.device("cpu")) is None


def test_peak_memory_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        memory.peak_memory(tiny_model())


# ---- the engine on CPU (eager) ---------------------------------------------------------------
def _random_norms(model):
    """Norm weights other than 1, so that a norm applied twice, skipped or swapped (Qwen3's q_norm and k_norm) shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _engine_and_hf_prefill(model):
    """The last position's logits of a batch of prompts: the engine's prefill, and the HF forward's."""
    prompt = torch.randint(0, 256, (3, 11))
    with torch.no_grad():
        ref = model(prompt).logits[:, -1]
    return Engine(model, max_batch=4, max_seq_len=32).prefill(prompt), ref


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_engine_prefill_logits_equal_the_hf_forward(arch):
    """rms_norm_eps other than the default 1e-6: each norm's own epsilon is the one the fused norms use."""
    out, ref = _engine_and_hf_prefill(_random_norms(tiny_model(arch, rms_norm_eps=1e-2)))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_pytorch_path_in_bfloat16_gives_the_hf_logits_bit_for_bit(arch, monkeypatch):
    """The engine's PyTorch ops (no Triton) round where HF's modules round: bfloat16 logits equal, bit for bit,
    Qwen3's q_norm / k_norm included. A norm's weight taken in float32 (a cast in `_rmsnorm_params`) left norm(h)
    in float32 there, where HF's is bfloat16."""
    monkeypatch.setattr(engine_mod, "triton", None)
    out, ref = _engine_and_hf_prefill(_random_norms(tiny_model(arch, dtype=torch.bfloat16)))
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


@pytest.mark.parametrize("replaced", [("q_norm", "k_norm"), ("q_norm",), ("k_norm",)])
def test_engine_runs_head_norms_other_than_rmsnorm_through_their_own_forward(replaced):
    """Qwen3's q_norm / k_norm are fused into RoPE as HF's RMSNorm; any other module there is called as it is, told
    by its class, not by the weight and variance_epsilon HF's RMSNorm has too, and when only one of the two is
    another module (the other, then, not fused without its pair: k went un-normed). Their hooks run in the engine's
    forward, so the engine does not warn of them: of the HF RMSNorm beside another module either (it did)."""
    model = _random_norms(tiny_model("qwen3"))
    head_dim = model.config.head_dim
    for layer in model.model.layers:
        for name in replaced:
            norm = nn.LayerNorm(head_dim)
            nn.init.uniform_(norm.weight, 0.5, 1.5)
            nn.init.uniform_(norm.bias, -0.5, 0.5)
            norm.variance_epsilon = norm.eps
            setattr(layer.self_attn, name, norm)
        for name in ("q_norm", "k_norm"):  # HF's RMSNorm beside another module runs as a module too: its hook as well
            getattr(layer.self_attn, name).register_forward_hook(lambda m, i, o: o * 1.5)
    prompt = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        ref = model(prompt).logits[:, -1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = Engine(model, max_batch=2, max_seq_len=16)
    torch.testing.assert_close(engine.prefill(prompt), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_engine_greedy_tokens_equal_hf_generate_on_cpu(arch):
    model = tiny_model(arch, initializer_range=0.2)
    prompt = torch.randint(0, 256, (2, 9))
    engine = Engine(model, max_batch=2, max_seq_len=40)
    assert torch.equal(engine.generate(prompt, 24), hf_greedy(model, prompt, 24))
    # a second, shorter sequence reuses the cache from position 0
    assert torch.equal(engine.generate(prompt[:1, :5], 6), hf_greedy(model, prompt[:1, :5], 6))


@pytest.mark.parametrize("rope,context,max_seq_len,warns", [
    ({"rope_type": "linear", "factor": 2.0}, 64, 64, False),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 32}, 64, 64, False),
    ({"rope_type": "dynamic", "factor": 4.0}, 60, None, False),  # the cache's 64 rows outgrow the context
    ({"rope_type": "dynamic", "factor": 4.0}, 64, 128, True),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
      "original_max_position_embeddings": 32}, 64, 64, True),
])
def test_scaled_ropes_run_a_prompt_within_the_context_as_transformers_does(rope, context, max_seq_len, warns):
    """'dynamic' and 'longrope' frequencies follow the longest position of a call: one table for the whole cache
    scaled every position once the cache outgrew the context (logits 1.8 / 5.6 off on a 10-token prompt)."""
    model = tiny_model(rope_parameters={**rope, "rope_theta": 10000.0}, max_position_embeddings=context,
                       head_dim=16, initializer_range=0.3)
    prompt = torch.randint(0, 256, (1, 10))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        engine = Engine(model, max_seq_len=max_seq_len)
    assert any("rescales its frequencies" in str(w.message) for w in said) == warns
    with torch.no_grad():
        torch.testing.assert_close(engine.prefill(prompt), model(prompt).logits[:, -1], rtol=1e-4, atol=1e-5)
    assert torch.equal(engine.generate(prompt, 12), hf_greedy(model, prompt, 12))


def test_a_dynamic_rope_grown_by_an_earlier_long_call_is_reset_for_the_engines_table():
    """A forward past the context grows a 'dynamic' rope's frequencies, which a call of exactly the context's length
    keeps (transformers resets them below it): the table of a cache as long as the context was scaled everywhere, and
    one taken as far as the grown length past it too."""
    model = tiny_model(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
                       max_position_embeddings=64, head_dim=16, initializer_range=0.3)
    prompt = torch.randint(0, 256, (1, 10))
    for max_seq_len in (64, 96):  # past the context, the table's first 64 rows alike (its context is not the grown one)
        with torch.no_grad():
            model(torch.randint(0, 256, (1, 80)))  # grows them
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # past the context: said, as the test of scaled ropes above checks
            engine = Engine(model, max_seq_len=max_seq_len)
        with torch.no_grad():
            torch.testing.assert_close(engine.prefill(prompt), model(prompt).logits[:, -1], rtol=1e-4, atol=1e-5)


def test_engine_generate_stops_once_every_sequence_made_a_stop_token():
    model = tiny_model(initializer_range=0.2)
    prompt = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    engine = Engine(model, max_batch=2, max_seq_len=40)
    full = engine.generate(prompt, 24)
    # a stop token for each sequence: its first new token that did not come earlier in it, from step 2 on
    firsts = [next(i for i in range(2, 24) if row[i] not in row[:i]) for row in full.tolist()]
    stops = {full[b, i].item() for b, i in enumerate(firsts)}
    ends = [min(i for i, t in enumerate(row) if t in stops) for row in full.tolist()]
    out = engine.generate(prompt, 24, stop_tokens=stops)
    assert torch.equal(out, past_stop(full[:, :max(ends) + 1], stops))  # the CPU checks every step
    unmade = min(set(range(256)) - set(full.flatten().tolist()))
    assert torch.equal(engine.generate(prompt, 24, stop_tokens={unmade}), full)  # never made: all 24


@pytest.mark.parametrize("skip", [["lm_head"], []])
def test_engine_runs_quantized_linears_and_matches_hf_generate(skip):
    model = tiny_model(initializer_range=0.2)
    quantize_model(model, QuantConfig(mode="w4a16", group_size=32, modules_to_not_convert=skip), progress=False)
    prompt = torch.randint(0, 256, (1, 7))
    assert torch.equal(Engine(model, max_seq_len=32).generate(prompt, 12), hf_greedy(model, prompt, 12))


def test_engine_refuses_sequences_longer_than_its_cache():
    engine = Engine(tiny_model(), max_batch=1, max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        engine.generate(torch.zeros(1, 10, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="max_batch"):
        engine.prefill(torch.zeros(2, 4, dtype=torch.long))


# ---- the fused glue kernels (CUDA, or the Triton interpreter on the CPU) ----------------------
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None)
needs_kernel = pytest.mark.skipif(engine_mod.triton is None or KERNEL_DEVICE is None,
                                  reason="needs CUDA, or TRITON_INTERPRET=1 on the CPU")


@pytest.fixture
def poisoned(monkeypatch):
    """The kernels' outputs and scratch (torch.empty / empty_like) hold NaN or the largest integer until
    written, on the CPU (interpreter) as on CUDA: an element a kernel leaves unwritten cannot pass."""
    poison_new_tensors(monkeypatch, cpu=KERNEL_DEVICE == "cpu")


def glue_outputs(dtype, device):
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)
    out = list(engine_mod.add_rmsnorm(r(5, 96), r(5, 96), r(96), 1e-5))
    out += list(engine_mod.add_rmsnorm(r(5, 96), None, r(96), 1e-6))
    # in a GPTQ act-order layer's input order (permuted inside the program; masked tail of the row)
    out += list(engine_mod.add_rmsnorm(r(5, 96), r(5, 96), r(96), 1e-5,
                                       columns=torch.randperm(96, generator=g).to(device)))
    out.append(engine_mod.silu_mul(r(3, 200), r(3, 200)))
    # the gate and up slices of one stacked output (rows 2 * 1100 + 7 apart), two column blocks of 1024
    gu = r(1, 3, 2 * 1100 + 7)
    out.append(engine_mod.silu_mul(gu[..., :1100], gu[..., 1100:2200]))
    # RoPE heads go ROPE_HEADS = 8 to a program: fewer than a block, and a whole block and a part
    # positions shared by the batch [T] (prefill), each sequence's own [B, 1] (decode), and [B, T]
    for B, T, H, KV, D, S, pos in ((2, 3, 4, 2, 16, 32, [5, 6, 7]), (1, 2, 12, 10, 32, 8, [5, 6]),
                                   (3, 1, 4, 2, 16, 32, [[9], [0], [31]]), (2, 2, 4, 1, 16, 16, [[3, 4], [12, 13]])):
        kc, vc = (r(B, KV, S, D) for _ in range(2))  # slots the call does not write keep their values
        out.append(engine_mod.rope_and_cache(r(B, T, H * D), r(B, T, KV * D), r(B, T, KV * D), r(S, D), r(S, D),
                                             torch.tensor(pos, device=device), kc, vc, H, KV, D))
        out += [kc, vc]
    # q, k and v as the slices of one stacked q/k/v output (rows (H + 2 KV) D + 5 apart), positions [B, T]
    B, T, H, KV, D, S = 2, 3, 12, 2, 16, 16
    qkv = r(B, T, (H + 2 * KV) * D + 5)
    q, k, v = qkv[..., :H * D], qkv[..., H * D:(H + KV) * D], qkv[..., (H + KV) * D:(H + 2 * KV) * D]
    kc, vc = r(B, KV, S, D), r(B, KV, S, D)
    pos = torch.tensor([[2, 3, 4], [13, 14, 15]], device=device)
    out += [engine_mod.rope_and_cache(q, k, v, r(S, D), r(S, D), pos, kc, vc, H, KV, D), kc, vc]
    # Qwen3's per-head RMSNorms of q and k first (each its own weight and eps), in that stacked output too, and
    # at decode; q scaled far from 1, which only the norm brings back
    kc, vc = r(B, KV, S, D), r(B, KV, S, D)
    norms = ((r(D), 1e-6), (r(D), 1e-2))
    out += [engine_mod.rope_and_cache(q * 30, k, v, r(S, D), r(S, D), pos, kc, vc, H, KV, D, norms), kc, vc]
    B, H, KV, D, S = 3, 12, 10, 32, 8
    kc, vc = r(B, KV, S, D), r(B, KV, S, D)
    out += [engine_mod.rope_and_cache(r(B, 1, H * D), r(B, 1, KV * D), r(B, 1, KV * D), r(S, D), r(S, D),
                                      torch.tensor([[7], [0], [3]], device=device), kc, vc, H, KV, D,
                                      ((r(D), 1e-6), (r(D), 1e-6))), kc, vc]
    return out


def attention_tolerance(dtype) -> dict:
    """The kernel's decode attention sums in another order than SDPA: equal to about one rounding of the dtype."""
    return dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=4e-3, atol=2e-4)


def attention_outputs(dtype, device):
    """decode_attention: one split (short cache), eight splits of which the last ones see no key, one key."""
    g = torch.Generator().manual_seed(2)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)
    out = []
    # one position for the batch ([1]), or each sequence its own ([B]: short and long ones side by side)
    for (B2, H2, rep, D2, S2, p) in ((2, 2, 2, 16, 32, [6]), (1, 2, 3, 32, 300, [250]), (1, 1, 1, 16, 64, [0]),
                                     (3, 2, 2, 16, 300, [0, 280, 37])):
        at = torch.tensor(p, device=device)
        mask = torch.zeros(len(p), S2, dtype=dtype, device=device).masked_fill(
            torch.arange(S2, device=device) > at[:, None], float("-inf")).view(len(p), 1, 1, S2)
        args = (r(B2, H2, rep, D2), r(B2, H2, S2, D2), r(B2, H2, S2, D2), at, D2 ** -0.5, mask)
        out.append(engine_mod.decode_attention(*args))
        # stored in a GPTQ act-order o_proj's input order (each sequence's columns scattered)
        out.append(engine_mod.decode_attention(*args, torch.randperm(H2 * rep * D2, generator=g).to(device)))
    return out


@needs_kernel
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_glue_kernels_equal_the_pytorch_ops_they_replace(dtype, monkeypatch, poisoned):
    fused, fused_attn = glue_outputs(dtype, KERNEL_DEVICE), attention_outputs(dtype, KERNEL_DEVICE)
    assert engine_mod._glue_failure is None  # the kernels ran, nothing fell back
    monkeypatch.setattr(engine_mod, "triton", None)
    plain, plain_attn = glue_outputs(dtype, KERNEL_DEVICE), attention_outputs(dtype, KERNEL_DEVICE)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b)
    for a, b in zip(fused_attn, plain_attn):
        torch.testing.assert_close(a, b, **attention_tolerance(dtype))


def long_context_attention_outputs(dtype, device):
    """decode_attention of sequences several blocks of keys long, on a GPU of few SMs (`num_sms` patched to 4: two
    splits for these six sequence x kv heads, each split reading several blocks, so each program's online softmax
    rescales what it summed): lengths at the edges of a split's share (129 = 2 * 64 + 1: one key in the second split)
    and of a block, a scale other than D ** -0.5, and in one head a key whose score (about 140) overflows exp() unless
    each program and the combine subtract the running maximum. Past each sequence's position the kernel's cache
    holds NaN keys and infinite values, which no program may read (PyTorch's path gets the same cache finite)."""
    g = torch.Generator().manual_seed(5)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)
    B, H, rep, D, S, scale = 3, 2, 2, 16, 520, 0.3
    at = torch.tensor([256, 128, 411], device=device)
    q, k, v = r(B, H, rep, D), r(B, H, S, D), r(B, H, S, D)
    k[2, 1, 10] = 25 * q[2, 1, 0]  # in the first split, blocks before its others: score about 25 * D * scale
    past = torch.arange(S, device=device) > at[:, None]
    mask = torch.zeros(B, S, dtype=dtype, device=device).masked_fill(past, float("-inf")).view(B, 1, 1, S)
    out = []
    for scatter in (None, torch.randperm(H * rep * D, generator=g).to(device)):
        if engine_mod.triton is None:  # PyTorch's path: SDPA's masked weights are 0, but 0 * NaN is not
            out.append(engine_mod.decode_attention(q, k, v, at, scale, mask, scatter))
        else:
            garbage = past[:, None, :, None].expand_as(k)
            out.append(engine_mod.decode_attention(q, k.masked_fill(garbage, float("nan")),
                                                   v.masked_fill(garbage, float("inf")), at, scale, mask, scatter))
    return out


@needs_kernel
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block", [64, 32, 128])  # the shipped block of keys, and what decode_attention_sweep.py tries
def test_decode_attention_over_several_blocks_a_split_equals_sdpa(dtype, block, monkeypatch, poisoned):
    monkeypatch.setattr(engine_mod, "num_sms", lambda device: 4)
    monkeypatch.setattr(engine_mod, "DECODE_ATTENTION_BLOCK", block)
    fused = long_context_attention_outputs(dtype, KERNEL_DEVICE)
    assert engine_mod._glue_failure is None
    monkeypatch.setattr(engine_mod, "triton", None)
    plain = long_context_attention_outputs(dtype, KERNEL_DEVICE)
    for a, b in zip(fused, plain):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **attention_tolerance(dtype))


@needs_kernel
@pytest.mark.interpreter
# (the interpreter does not round to bfloat16 as the GPU does: bf16 on CUDA only)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16] if torch.cuda.is_available() else [torch.float16])
@pytest.mark.parametrize("order", ["natural", "even_odd"])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rmsnorm_quantizing_for_w4a4_equals_the_norm_then_the_act_quant(dtype, order, with_residual, poisoned):
    from nibble.kernels import reference, w4a4
    g = torch.Generator().manual_seed(3)
    rows, n = 7, 96
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    x[2] = 0  # a zero token (no residual): scale 0, codes 0, no NaN
    x[4, 5], x[5, 7] = float("inf"), float("nan")  # saturated as the act-quant kernel saturates
    res = (torch.randn(rows, n, generator=g) * 3).to(dtype) if with_residual else None
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    args = [t.to(KERNEL_DEVICE) if t is not None else None for t in (x, res, w)]
    h, q, scale = engine_mod.add_rmsnorm_quantize(args[0].view(1, rows, n), None if res is None else
                                                  args[1].view(1, rows, n), args[2], 1e-5, order)
    assert engine_mod._glue_failure is None
    assert q.shape == (rows, n) and q.dtype == torch.int8 and scale.shape == (rows,)
    # exactly what the unfused kernels give: the norm kernel, then the act-quant kernel
    h2, y2 = engine_mod.add_rmsnorm(*(t.view(1, rows, n) if t is not None else None for t in args[:2]), args[2], 1e-5)
    torch.testing.assert_close(h, h2, rtol=0, atol=0, equal_nan=True)
    assert_quantized_equal((q, scale), w4a4.quantize_activations(y2.view(rows, n), False, order))
    # and the spec on PyTorch's norm (its sum may round in another order: an ulp in rare elements)
    h_ref = x if res is None else res + x
    hf = h_ref.float()
    y = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    torch.testing.assert_close(h.view(rows, n).cpu(), h_ref, equal_nan=True)
    assert_quantized_close((q, scale), reference.quantize_activations(y), order)


def assert_quantized_equal(got, want):
    assert got[0].dtype == torch.int8 and got[0].shape == want[0].shape and got[1].shape == want[1].shape
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def assert_quantized_close(got, spec, order):
    """Codes and scales of a kernel vs the spec's on PyTorch's 16-bit values, which may differ from
    the kernel's by an ulp in rare elements: scales equal to ~an ulp, codes by at most 1, rarely."""
    from nibble.kernels import w4a4
    q, scale = (t.cpu() for t in got)
    q_ref, s_ref = spec
    if order == "even_odd":
        q_ref = w4a4.to_even_odd(q_ref)
    assert torch.isfinite(scale).all()
    torch.testing.assert_close(scale, s_ref, rtol=1e-2, atol=0)
    diff = (q.int() - q_ref.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.02


@needs_kernel
@pytest.mark.interpreter
@pytest.mark.parametrize("launches", [None, (512, 128, 0), (640, 128, 3)])
def test_sampling_kernel_draws_the_tokens_the_pytorch_ops_draw(monkeypatch, launches, poisoned):
    """Same seed, same draws: the kernels' tokens equal `_sample_plain`'s (sort-based top-p) row for row,
    over vocabularies of one to several chunks and blocks, temperatures, top-k (in the launches and by
    torch.topk) and top-p (tiny ones, where the rejection takes many rounds, over chunks and then over whole
    rows), logits in fp32 and bf16, a strided batch, -inf logits. ``launches``: (chunk, block, rounds over chunks), None as shipped."""
    if launches is not None:
        for name, value in zip(("SAMPLE_CHUNK", "SAMPLE_BLOCK", "SAMPLE_ROUNDS"), launches):
            monkeypatch.setattr(engine_mod, name, value)
    g = torch.Generator().manual_seed(4)
    dtypes = [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.float32, torch.float16]
    # every case takes the same paths whatever the seed: the interpreter (half of `make test`'s second pass with 4)
    # draws 2 a case, the GPU 4
    seeds = 2 if KERNEL_DEVICE == "cpu" else 4
    cases, rounds = 0, 0
    for case in range(48):
        V = int(torch.randint(2, 3 * engine_mod.SAMPLE_CHUNK, (1,), generator=g)) if case % 4 else 2 + case
        B = 1 + case % 3
        logits = torch.randn(B, V + 5, generator=g) * float(0.5 + 6 * torch.rand(1, generator=g))
        logits[:, torch.randint(0, V + 5, (V // 10,), generator=g)] = -torch.inf  # tokens a model rules out
        logits = logits.to(dtypes[case % 2]).to(KERNEL_DEVICE)[:, 2:V + 2]  # rows V + 5 apart
        # top-k over the chunks' largest (up to SAMPLE_TOPK_MAX), and by torch.topk beyond
        top_k = int(torch.randint(1, (V + 3) if case % 2 else 140, (1,), generator=g)) if case % 3 == 0 else None
        top_p = (0.9, 0.5, 1e-3, 1.0, float(torch.rand(1, generator=g)) + 1e-4)[case % 5]
        sampling = engine_mod.Sampling(float(0.2 + 2 * torch.rand(1, generator=g)), top_k, top_p)
        if sampling.greedy:
            continue
        for seed in range(seeds):
            torch.manual_seed(seed)
            ours = engine_mod.next_tokens(logits, sampling)
            torch.manual_seed(seed)
            theirs = engine_mod._sample_plain(logits, sampling)
            assert ours.dtype == torch.int64 and torch.equal(ours, theirs), (case, V, sampling, seed)
            rounds += int((ours != logits.float().argmax(-1)).sum())
        cases += 1
    assert engine_mod._glue_failure is None  # the kernel ran, nothing fell back
    assert cases > 30 and rounds > 12.5 * seeds  # most draws were not the top token: the race itself was tested
    # rows without a finite max end too (no endless rounds): every token ruled out, or one logit at +inf
    odd = torch.randn(2, 300).to(KERNEL_DEVICE)
    odd[0] = -torch.inf
    odd[1, 7] = torch.inf
    assert engine_mod.next_tokens(odd, engine_mod.Sampling(0.8, top_p=0.9)).tolist()[1] == 7


@needs_kernel
@pytest.mark.interpreter
@pytest.mark.parametrize("chunk", [None, 256])
def test_greedy_kernel_picks_torch_argmax_tokens(monkeypatch, chunk, poisoned):
    """`next_tokens` greedy (chunks, then rows) equals ``torch.argmax`` row for row: ties inside a chunk and
    across chunks (the first index), NaN (the first NaN wins, over +inf too; a negative NaN too), +-inf, -0.0 against +0.0,
    rows of one token and rows wholly -inf, fp32 and 16-bit logits, strided rows; one chunk or many
    (``chunk``: SAMPLE_CHUNK, None as shipped)."""
    if chunk is not None:
        monkeypatch.setattr(engine_mod, "SAMPLE_CHUNK", chunk)
        monkeypatch.setattr(engine_mod, "SAMPLE_BLOCK", 64)
    size = engine_mod.SAMPLE_CHUNK
    g = torch.Generator().manual_seed(5)
    dtypes = [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.float32, torch.float16]
    for case in range(14):
        V = (1, 2, size, size + 1, 3 * size - 7)[case % 5] if case < 10 else int(torch.randint(2, 3 * size, (1,), generator=g))
        B = 1 + case % 3
        x = torch.randn(B, V + 3, generator=g)
        cols = lambda n: torch.randint(0, V, (n,), generator=g)  # noqa: E731
        if V > 1:
            x[0, cols(3)] = x[0].max() + 1  # ties for the top, maybe in different chunks
            x[-1, cols(2)] = -torch.inf
        if case % 4 == 1:
            x[0, cols(2)] = torch.nan
            x[-1, cols(1)] = -torch.nan  # its sign bit set: a NaN all the same
        if case % 4 == 2:
            x[-1, cols(1)] = torch.inf
            x[-1, cols(1)] = torch.nan  # NaN beats +inf
        if case % 7 == 3:
            x[0] = -torch.inf  # no finite logit: the first index
        if case % 5 == 4:
            x[B - 1, 1:V + 1] = -x[B - 1, 1:V + 1].abs()
            first, later = sorted(torch.randperm(V, generator=g)[:2].tolist())
            x[B - 1, 1 + first], x[B - 1, 1 + later] = -0.0, 0.0  # they tie: the first (-0.0) wins
        logits = x.to(dtypes[case % 2]).to(KERNEL_DEVICE)[:, 1:V + 1]  # rows V + 3 apart
        ours = engine_mod.next_tokens(logits)
        assert ours.dtype == torch.int64 and torch.equal(ours, logits.argmax(-1)), (case, V, ours, logits.argmax(-1))
    assert engine_mod._glue_failure is None


def test_a_glue_kernel_that_fails_to_build_falls_back_to_pytorch_with_a_warning(monkeypatch):
    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("no C compiler")
    monkeypatch.setattr(engine_mod, "_use_triton", lambda x: True)
    monkeypatch.setattr(engine_mod, "triton", SimpleNamespace(next_power_of_2=lambda n: n))
    monkeypatch.setattr(engine_mod, "_add_rmsnorm_kernel", Broken(), raising=False)
    monkeypatch.setattr(engine_mod, "_glue_failure", None)
    x, w = torch.randn(3, 32), torch.randn(32)
    with pytest.warns(UserWarning, match="no C compiler"):
        h, y = engine_mod.add_rmsnorm(x, None, w, 1e-6)
    assert "no C compiler" in engine_mod._glue_failure
    torch.testing.assert_close(y, w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    engine_mod.silu_mul(x, x)  # later calls go straight to PyTorch, silently


# ---- speed helpers ---------------------------------------------------------------------------
def test_linear_flops_per_token_is_twice_the_decoder_linear_weights():
    for model in (tiny_model(), tiny_model(head_dim=32)):  # a head_dim of its own: not hidden_size / heads
        n = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, nn.Linear))
        assert speed.linear_flops_per_token(model) == 2 * n


def test_prefill_flops_count_each_sequences_causal_attention_and_its_last_tokens_lm_head():
    model = tiny_model()  # 2 layers of 4 heads of 16, hidden 64, vocabulary 256
    for T in (1, 5):
        pairs = T * (T + 1) // 2  # the query-key pairs of a causal prompt: QK^T and PV, 2 FLOPs each a pair
        one = T * speed.linear_flops_per_token(model) + 2 * 2 * 4 * 16 * pairs * 2 + 2 * 64 * 256
        assert speed.prefill_flops(model, 1, T) == one
        assert speed.prefill_flops(model, 3, T) == 3 * one


def test_alternating_prefills_alternate_the_engine_order_every_round(monkeypatch):
    calls = []
    monkeypatch.setattr(speed, "measure_prefill", lambda engine, b, t: calls.append((engine, (b, t))) or len(calls))
    seen = []
    times = speed.alternating_prefills({"a": "A", "b": "B", "c": "C"}, [(1, 8), (2, 4)], 3,
                                       lambda r, times: seen.append(r))
    order = [engine for engine, _ in calls]
    assert order == ["A", "B", "C"] * 2 + ["C", "B", "A"] * 2 + ["A", "B", "C"] * 2
    assert [shape for _, shape in calls[:6]] == [(1, 8)] * 3 + [(2, 4)] * 3
    assert seen == [0, 1, 2]
    assert times["a", (1, 8)] == [1, 9, 13] and times["c", (2, 4)] == [6, 10, 18]


def test_alternating_decodes_alternate_the_engine_order_every_round(monkeypatch):
    calls = []
    monkeypatch.setattr(speed, "measure_decode", lambda engine, b, p, t, reps: calls.append((engine, b, p, t, reps))
                        or len(calls))
    times = speed.alternating_decodes({"a": "A", "b": "B"}, 8, 128, 64, 4, reps=2)
    assert [c[0] for c in calls] == ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert all(c[1:] == (8, 128, 64, 2) for c in calls)
    assert times == {"a": [1, 4, 5, 8], "b": [2, 3, 6, 7]}


def test_speed_models_have_the_published_shapes():
    cfg = speed.SPEED_MODELS["llama-3-8b"]
    assert (cfg["intermediate_size"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (14336, 8, 128256)
    model = speed.random_model("llama-2-7b", device="meta", num_hidden_layers=1)
    assert model.model.layers[0].mlp.down_proj.weight.shape == (4096, 11008)
    assert model.lm_head.weight.shape == (32000, 4096) and model.lm_head.weight.dtype == torch.bfloat16
    qwen2 = speed.random_model("qwen2.5-7b", device="meta", num_hidden_layers=1)
    attention = qwen2.model.layers[0].self_attn
    assert type(qwen2).__name__ == "Qwen2ForCausalLM" and qwen2.lm_head.weight.dtype == torch.bfloat16
    assert attention.k_proj.weight.shape == (512, 3584) and attention.k_proj.bias is not None
    qwen3 = speed.random_model("qwen3-8b", device="meta", num_hidden_layers=1)
    attention = qwen3.model.layers[0].self_attn
    assert type(qwen3).__name__ == "Qwen3ForCausalLM" and attention.q_norm.weight.shape == (128,)
    assert qwen3.model.layers[0].mlp.down_proj.weight.shape == (4096, 12288)
    assert qwen3.lm_head.weight.shape == (151936, 4096) and qwen3.lm_head.weight is not qwen3.model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"unknown speed model 'llama-9b'; choose from \['llama-2-7b'"):
        speed.random_model("llama-9b", device="meta")  # a KeyError of the bare name


def test_quantize_in_place_without_a_config_and_release_leave_the_model_as_it_was_and_close_engines():
    """The bf16 rows: no config, no quantization (quantize_model's default config quantized it). `release` closes the
    engines given, whose caches the next measurement's peak must not count."""
    model = tiny_model()
    assert speed.quantize_in_place(model, None) >= 0
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    engine = Engine(model, max_seq_len=16)
    speed.release(engine, "not an engine")
    assert engine.k_cache is None and engine.v_cache is None


def test_speed_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        speed.speed_benchmark(tiny_model(), "tiny")


# ---- GPU: CUDA graphs -------------------------------------------------------------------------
def first_divergences(model, prompt, engine_tokens, hf_tokens) -> list[tuple[int, int, float, float]]:
    """(row, step, gap, spacing) for each row whose tokens part: the first step they differ at, HF's own logit of its
    token there less that of the engine's, and one bf16 spacing at that logit's magnitude (the smallest gap bf16
    logits have)."""
    out = []
    for row in range(prompt.shape[0]):
        diff = (engine_tokens[row] != hf_tokens[row]).nonzero()
        if not len(diff):
            continue
        d = diff[0].item()
        ctx = torch.cat([prompt[row], hf_tokens[row, :d]])[None]
        with torch.no_grad():
            logits = model(ctx).logits[0, -1].float()
        top = logits[hf_tokens[row, d]].abs().item()
        spacing = 2.0 ** (math.floor(math.log2(top)) - 7) if top > 0 else 0.0  # bf16: 8 significant bits
        out.append((row, d, (logits[hf_tokens[row, d]] - logits[engine_tokens[row, d]]).item(), spacing))
    return out


def assert_greedy_equal_up_to_near_ties(model, prompt, engine_tokens, hf_tokens, tol):
    """Exact equality, except that at the first divergence (if any) the two candidate tokens must be
    a near-tie of HF's own logits (bf16 rounding differs between the two attention paths): a gap of
    at most ``tol`` or one bf16 spacing at the logit's magnitude."""
    for row, d, gap, spacing in first_divergences(model, prompt, engine_tokens, hf_tokens):
        assert gap <= max(tol, spacing), f"row {row}: tokens diverge at step {d} with a logit gap of {gap:.4f} (> {tol})"


def teacher_forced_agreement(engine, model, prompt, hf_tokens) -> tuple[int, int]:
    """How many of HF's greedy tokens (sdpa attention) the engine picks when each of its decode steps is fed
    HF's previous token, and how many HF's own eager attention picks, teacher-forced over the same sequence.

    Under W4A4 these random models are chaotic: a one-ulp difference before an activation quantization (an
    attention output, a norm's rstd summed in another order) can move a per-token 4-bit code by a step and the
    logits by about 1, so two correct implementations part within a few free-running tokens. On an H100 (session
    76, `benchmarks/results/session76-h100/w4a4-greedy-divergence.jsonl`) the engine left HF's qwen3 w4a4 tokens
    at step 18 with a logit gap of 1.19, and HF's eager and sdpa paths, teacher-forced, disagree on the argmax at
    45-62 of 96 positions, with gaps up to 7. Fed the same context at every step, the engine must agree with HF
    at least as often as HF's other attention path does (there: the engine 59-64 of 64, eager 20-34)."""
    B, n = hf_tokens.shape
    engine.prefill(prompt)
    engine_agrees = (engine.token[:B, 0] == hf_tokens[:, 0]).sum().item()
    for t in range(n - 1):
        with torch.inference_mode():  # the engine's state is made under inference mode
            engine.token[:B, 0].copy_(hf_tokens[:, t])
        engine_agrees += (engine.decode(1)[:, 0] == hf_tokens[:, t + 1]).sum().item()
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            logits = model(torch.cat([prompt, hf_tokens[:, :-1]], 1)).logits[:, prompt.shape[1] - 1:]
    finally:
        model.set_attn_implementation(implementation)
    return engine_agrees, (logits.argmax(-1) == hf_tokens).sum().item()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("arch,mode", [("llama", "bf16"), ("llama", "w4a16"), ("llama", "w4a4"),
                                       ("llama", "w4a16-lmhead"), ("qwen3", "w4a16"), ("qwen3", "w4a4")])
def test_cuda_graph_engine_greedy_tokens_equal_hf_generate(arch, mode, monkeypatch):
    model = tiny_model(arch, dtype=torch.bfloat16, initializer_range=0.2, hidden_size=256, intermediate_size=512,
                       num_attention_heads=8, num_key_value_heads=2, **({"head_dim": 64} if arch == "qwen3" else {}))
    model.cuda()
    if mode != "bf16":
        quantize_model(model, report.quant_config(mode, group_size=64 if mode.startswith("w4a16") else -1),
                       progress=False)
        assert isinstance(model.lm_head, QuantLinear) == mode.endswith("lmhead")
    fused = []  # W4A4: the norms quantize for the q/k/v and gate/up projections
    norm_quantize = engine_mod.add_rmsnorm_quantize
    monkeypatch.setattr(engine_mod, "add_rmsnorm_quantize", lambda *a: fused.append(a[-1]) or norm_quantize(*a))
    gated = []  # W4A4 on Hopper: the gate/up GEMM multiplies in its epilogue (forced at 32 tokens)
    monkeypatch.setattr(w4a4, "GATED_MIN_TOKENS", 17)
    silu_mul_product = w4a4.w4a4_wgmma_silu_mul
    monkeypatch.setattr(w4a4, "w4a4_wgmma_silu_mul", lambda *a, **k: gated.append(1) or silu_mul_product(*a, **k))
    prompt = torch.randint(0, 256, (2, 16), device="cuda")
    engine = Engine(model, max_batch=2, max_seq_len=64)
    assert engine.cuda_graphs
    tokens = engine.generate(prompt, 32)
    assert ("decode", 2) in engine._graphs and ("prefill", 2, 16) in engine._graphs
    assert torch.equal(engine.generate(prompt, 32), tokens)  # replaying the graphs is deterministic
    assert (len(fused) > 0) == (mode == "w4a4")
    assert (len(gated) > 0) == (mode == "w4a4" and w4a4.wgmma_applicable(32, 512, 256, "cuda"))
    hf_tokens = hf_greedy(model, prompt, 32)
    if mode == "w4a4":
        engine_agrees, eager_agrees = teacher_forced_agreement(engine, model, prompt, hf_tokens)
        assert engine_agrees >= eager_agrees, (engine_agrees, eager_agrees)
    else:
        assert_greedy_equal_up_to_near_ties(model, prompt, tokens, hf_tokens, tol=0.05)


@gpu
@pytest.mark.gpu
def test_w4a4_gated_gemm_prefill_equals_the_products_and_glue_kernel(monkeypatch):
    """The W4A4 engine's prefill with gate/up as one GEMM that multiplies in its epilogue gives the
    logits of the two products then the SiLU(gate) * up kernel, to the bit (Hopper; forced at 74
    tokens, and off at 74 by default: GATED_MIN_TOKENS)."""
    if not w4a4.wgmma_applicable(64, 512, 256, "cuda"):
        pytest.skip("the gated GEMM runs on Hopper (sm_90) only")
    model = tiny_model(dtype=torch.bfloat16, initializer_range=0.2, hidden_size=256, intermediate_size=576).cuda()
    quantize_model(model, QuantConfig(mode="w4a4"), progress=False)
    prompt = torch.randint(0, 256, (2, 37), device="cuda")
    positions, last = torch.arange(37, device="cuda"), torch.tensor([36, 20], device="cuda")
    calls = []
    monkeypatch.setattr(w4a4, "GATED_MIN_TOKENS", 17)
    silu_mul_product = w4a4.w4a4_wgmma_silu_mul
    monkeypatch.setattr(w4a4, "w4a4_wgmma_silu_mul", lambda *a, **k: calls.append(1) or silu_mul_product(*a, **k))
    with torch.no_grad():
        logits = Engine(model, max_batch=2, max_seq_len=64, cuda_graphs=False).forward(prompt, positions, last)
        assert len(calls) == model.config.num_hidden_layers
        monkeypatch.setattr(w4a4, "GATED_MIN_TOKENS", 1024)
        unfused = Engine(model, max_batch=2, max_seq_len=64, cuda_graphs=False).forward(prompt, positions, last)
    assert len(calls) == model.config.num_hidden_layers and torch.equal(logits, unfused)


@gpu
@pytest.mark.gpu
def test_cuda_graph_engine_equals_the_eager_engine():
    model = tiny_model(dtype=torch.bfloat16, initializer_range=0.2).cuda()
    prompt = torch.randint(0, 256, (1, 8), device="cuda")
    graphed = Engine(model, max_seq_len=48).generate(prompt, 24)
    eager = Engine(model, max_seq_len=48, cuda_graphs=False).generate(prompt, 24)
    assert torch.equal(graphed, eager)


@gpu
@pytest.mark.gpu
def test_cuda_graph_engine_asks_about_stop_tokens_every_few_steps():
    model = tiny_model(dtype=torch.bfloat16, initializer_range=0.2).cuda()
    prompt = torch.randint(0, 256, (2, 8), device="cuda")
    engine = Engine(model, max_batch=2, max_seq_len=64)
    full = engine.generate(prompt, 40)
    firsts = [next(i for i in range(2, 40) if row[i] not in row[:i]) for row in full.tolist()]
    stops = {full[b, i].item() for b, i in enumerate(firsts)}
    last = max(min(i for i, t in enumerate(row) if t in stops) for row in full.tolist())
    every = engine_mod.STOP_CHECK_STEPS
    assert torch.equal(engine.generate(prompt, 40, stop_tokens=stops),
                       past_stop(full[:, :min(40, 1 + every * -(-last // every))], stops))


@gpu
@pytest.mark.gpu
def test_peak_memory_covers_weights_and_kv_cache():
    model = tiny_model(dtype=torch.bfloat16).cuda()
    peak = memory.peak_memory(model, prompt_len=64, decode_tokens=16)
    assert peak["weights_bytes"] >= memory.weight_memory(model)["total_bytes"]
    c = model.config  # K and V of every layer, kv head and position of the 80-token cache, in bf16
    assert peak["kv_cache_bytes"] == 2 * c.num_hidden_layers * c.num_key_value_heads * 80 * c.head_dim * 2
    assert peak["peak_bytes"] >= peak["weights_bytes"] + peak["kv_cache_bytes"]


@gpu
@pytest.mark.gpu
def test_capturing_graphs_again_holds_no_more_memory():
    """The report measures config after config in one process: an engine's graphs, once closed, must
    leave nothing behind. (Warming each capture up on a fresh stream left a 32 MiB cuBLAS workspace
    per stream for the life of the process: 224 MiB more per config measured on the H200.)"""
    import gc
    model = tiny_model(dtype=torch.bfloat16).cuda()
    held = []
    for _ in range(3):
        engine = Engine(model, max_batch=2, max_seq_len=64)
        for b, t in ((1, 16), (2, 32)):
            engine.prefill(torch.randint(0, 256, (b, t), device="cuda"))
        engine.decode(2, collect=False)
        engine.close()
        del engine
        gc.collect()
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    assert held[2] == held[1], f"{(held[2] - held[1]) / 2**20:.1f} MiB more held after capturing again"
    assert timing.side_stream("cuda") is timing.side_stream()


@gpu
@pytest.mark.gpu
def test_a_capture_finds_the_scratch_its_warm_up_made():
    """`capture_graph` captures on the stream it warmed up on, so per-stream scratch (split-K counters,
    zero between calls) made in the warm-up is the one the graph uses. (Captured on another stream, every
    call in the graph allocated its own and recorded a memset: 2-3 us a call, H200, session 35.)"""
    from nibble.kernels.launch import split_counters
    seen = []
    graph, _ = timing.capture_graph(lambda: seen.append(split_counters(torch.device("cuda"), 8192).data_ptr()))
    graph.replay()
    torch.cuda.synchronize()
    assert len(seen) == 2 and seen[0] == seen[1]
