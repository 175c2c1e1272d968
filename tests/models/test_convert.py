import copy
import math
import os
import re
import warnings

import pytest
import torch
from torch import nn

from conftest import tiny_model
from nibble import QuantConfig, QuantLinear, quantize_model
from nibble.kernels.reference import dequantize
from nibble.models.convert import default_group_size, quantized_linears, weight_bytes


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_whole_model_conversion_keeps_the_model_working(arch, mode):
    model = tiny_model(arch)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
        quantize_model(model, QuantConfig(mode=mode, group_size=32 if mode == "w4a16" else None), progress=False)
        out = model(ids).logits
    names = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(names) == 2 * 7  # q k v o gate up down in each of the 2 layers
    assert not isinstance(model.lm_head, QuantLinear) and isinstance(model.model.embed_tokens, nn.Embedding)
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    cos = nn.functional.cosine_similarity(ref.flatten(), out.flatten(), dim=0)
    assert cos > (0.99 if mode == "w4a16" else 0.9)
    gen = model.generate(ids[:1, :4], max_new_tokens=6, do_sample=False)
    assert gen.shape == (1, 10)
    assert model.config.quantization_config["mode"] == mode


def test_a_meta_buffer_other_than_the_rotary_ones_is_a_checkpoint_error():
    """It was a plain ValueError, where the loaders' copy it replaced raised CheckpointError."""
    from nibble.models.convert import rebuild_non_persistent_buffers
    from nibble.models.checkpoint_files import CheckpointError

    model = tiny_model()
    model.model.norm.register_buffer("scale", torch.empty(8, device="meta"), persistent=False)  # what no file holds
    with pytest.raises(CheckpointError, match="^module model.norm has buffers the checkpoint does not hold"):
        rebuild_non_persistent_buffers(model, "cpu")


def test_weight_bytes_counts_scales_and_zeros():
    model = tiny_model()
    quantize_model(model, QuantConfig(group_size=64), progress=False)
    wb = weight_bytes(model)
    # 4 bits per weight + two fp16 per 64 weights = 0.25 + 4/64/2 ... of 16 bits
    assert wb["ratio"] == pytest.approx(0.25 + 2 * 2 / (64 * 2), rel=1e-6)
    # nothing quantized: no ratio, not a 0 that reads as every byte saved
    unquantized = weight_bytes(tiny_model())
    assert unquantized["quantized_bytes"] == 0 and math.isnan(unquantized["ratio"])


def test_weight_bytes_counts_the_bias_as_the_layer_holds_it():
    """A float32 model keeps float32 biases (qwen2's q/k/v): they were counted at 2 bytes each, fewer than the
    quantized linears hold. Every decoder linear is quantized here, so their bytes are the state dict's."""
    from nibble.eval.memory import linear_bytes, weight_memory

    model = tiny_model("qwen2")
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    assert model.model.layers[0].self_attn.q_proj.bias.dtype == torch.float32
    wb = weight_bytes(model)
    assert wb["quantized_bytes"] == linear_bytes(weight_memory(model))
    biases = sum(m.bias.numel() for _, m in quantized_linears(model) if m.bias is not None)
    assert wb["bf16_bytes"] == sum(m.in_features * m.out_features * 2 for _, m in quantized_linears(model)) + 2 * biases


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # lm_head tied to the embedding, and its own matrix
@pytest.mark.parametrize("rotate", [False, True])  # the rotation unties the head before it is quantized
def test_weight_bytes_saved_is_what_quantizing_the_head_too_saved(arch, rotate):
    """A tied head, held once in 16 bits (as the embedding, which keeps its table), was priced as its own matrix: a
    model that grew read as saving more than without the head."""
    from nibble.eval.memory import weight_memory

    model = tiny_model(arch, dtype=torch.bfloat16)
    before = weight_memory(model)["total_bytes"]
    config = (QuantConfig(mode="w4a4", rotation="hadamard", modules_to_not_convert=[]) if rotate else
              QuantConfig(group_size=32, modules_to_not_convert=[]))
    quantize_model(model, config, progress=False)
    wb = weight_bytes(model)
    assert wb["bf16_bytes"] - wb["quantized_bytes"] == before - weight_memory(model)["total_bytes"]
    assert model.config.quantization_config.get("lm_head_was_tied", False) == (arch == "llama")


@pytest.mark.parametrize("rotate_first", [False, True])  # tied, or untied by rotate_model
def test_a_tied_head_kept_in_16_bits_is_not_recorded_as_a_quantized_tied_head(rotate_first):
    """lm_head_was_tied says that the quantized head was the embedding's table in 16 bits (`weight_bytes` counts it 0
    bytes there, `nibble quantize` says so): a tied head that modules_to_not_convert keeps in 16 bits is no quantized
    head, whether the model still ties it or rotate_model untied it."""
    from nibble.models.rotation import rotate_model

    model = tiny_model("llama")  # its head tied to the embedding
    if rotate_first:
        rotate_model(model, seed=1)
    quantize_model(model, QuantConfig(mode="w4a4"), progress=False)  # lm_head kept, the default
    assert not isinstance(model.lm_head, QuantLinear)
    assert "lm_head_was_tied" not in model.config.quantization_config


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])  # a tied head, biases, a head of its own
@pytest.mark.parametrize("config", [QuantConfig(group_size=32), QuantConfig(group_size=32, modules_to_not_convert=[]),
                                    QuantConfig(mode="w4a4", rotation="hadamard")])
def test_num_parameters_counts_the_quantized_weights(arch, config, tmp_path):
    """transformers' num_parameters counts Parameters, and a QuantLinear holds its weight and bias as buffers: a
    quantized model read as its embeddings and norms (W4A16 SmolLM2-135M as 28M parameters)."""
    from nibble import load_quantized, save_quantized
    from nibble.models.convert import lm_head_tied

    model = tiny_model(arch)
    before = {k: model.num_parameters(exclude_embeddings=k) for k in (False, True)}
    tied = lm_head_tied(model)
    quantize_model(model, config, progress=False)
    # a head untied from the embedding (rotated, or quantized) holds a matrix of its own
    grown = model.config.vocab_size * model.config.hidden_size if tied and not lm_head_tied(model) else 0
    for counted in (model, copy.deepcopy(model), load_quantized(save_quantized(model, tmp_path), tokenizer=False)[0]):
        assert {k: counted.num_parameters(exclude_embeddings=k) for k in (False, True)} == \
            {k: n + grown for k, n in before.items()}
        # the INT4 weights are frozen buffers: not trainable
        assert counted.num_parameters(only_trainable=True) == sum(p.numel() for p in counted.parameters())


def test_default_group_size_follows_the_in_features():
    assert default_group_size(tiny_model(hidden_size=64, intermediate_size=192)) == 64
    assert default_group_size(tiny_model(hidden_size=128, intermediate_size=256)) == 128
    assert default_group_size(tiny_model(hidden_size=96, intermediate_size=288, num_attention_heads=3,
                                         num_key_value_heads=1)) == 32
    # of the linears to convert only: down_proj's 192 inputs kept in 16 bits leave the others' 128
    model = tiny_model(hidden_size=128, intermediate_size=192)
    assert default_group_size(model) == 64
    assert default_group_size(model, QuantConfig(modules_to_not_convert=["lm_head", "down_proj"])) == 128


def test_k_not_divisible_by_group_is_a_clear_error():
    with pytest.raises(ValueError, match="in_features=64 is not divisible by group_size=128"):
        quantize_model(tiny_model(), QuantConfig(group_size=128), progress=False)
    # where no group size of 128 / 64 / 32 divides every width, the layer's refusal stands, by name, without the hint
    # (default_group_size's own refusal names no layer)
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.q_proj: in_features=48 is not divisible by "
                                         r"group_size=32; pick a group size that divides it: 48 or 24 or 16 "
                                         r"\(Triton\), or -1 for per-channel$"):
        quantize_model(tiny_model(hidden_size=48, intermediate_size=96), QuantConfig(group_size=32), progress=False)


def test_unknown_architecture_is_a_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="unknown model architecture 'gpt2'.*llama, qwen2, qwen3, mistral"):
        quantize_model(model, QuantConfig(), progress=False)


@pytest.mark.parametrize("cls", ["LlamaForSequenceClassification", "LlamaModel", "Qwen2ForTokenClassification"])
def test_a_model_of_a_family_but_not_a_causal_lm_is_refused_by_name(cls, tmp_path):
    """A classification head quantized and saved, then nothing loaded it back; a bare LlamaModel crashed."""
    import transformers
    from nibble.eval.engine import Engine
    from conftest import tiny_config
    model = getattr(transformers, cls)(tiny_config("qwen2" if "Qwen2" in cls else "llama"))
    for call in (lambda: quantize_model(model, QuantConfig(group_size=32), progress=False), lambda: Engine(model)):
        with pytest.raises(ValueError, match=f"nibble converts causal LMs .*got {cls}.*AutoModelForCausalLM"):
            call()


@pytest.mark.parametrize("arch,mode", [("llama", "w4a16"), ("mistral", "w4a16"), ("qwen2", "w4a4")])
def test_lm_head_is_quantized_once_modules_to_not_convert_leaves_it_out(arch, mode):
    model = tiny_model(arch)  # llama and qwen2: lm_head tied to the embedding; mistral: its own
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    head, embed = model.lm_head.weight.detach().clone(), model.model.embed_tokens.weight.detach().clone()
    ids = torch.randint(0, 256, (2, 12))
    config = QuantConfig(mode=mode, group_size=32 if mode == "w4a16" else None, modules_to_not_convert=[])
    with torch.no_grad():
        ref = model(ids).logits
        quantize_model(model, config, progress=False)
        out = model(ids).logits
    assert tied == (arch != "mistral")
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.mode == mode
    assert len([m for m in model.modules() if isinstance(m, QuantLinear)]) == 2 * 7 + 1
    # the embedding is untouched and untied for good: transformers' tie_weights must not re-tie it
    assert torch.equal(model.model.embed_tokens.weight, embed) and model.config.tie_word_embeddings is False
    model.tie_weights()
    assert isinstance(model.lm_head, QuantLinear) and not hasattr(model.lm_head, "weight")
    # lm_head is plain RTN of its float weight in the config's mode
    x = torch.randn(3, 64)
    with torch.no_grad():
        lin = nn.Linear(64, 256, bias=False)
        lin.weight.copy_(head)
        torch.testing.assert_close(model.lm_head(x), QuantLinear.from_linear(lin, config)(x), rtol=0, atol=0)
    cos = nn.functional.cosine_similarity(ref.flatten(), out.flatten(), dim=0)
    assert cos > (0.98 if mode == "w4a16" else 0.85)
    assert model.generate(ids[:1, :4], max_new_tokens=6, do_sample=False).shape == (1, 10)


def test_default_keeps_lm_head_and_skips_by_suffix():
    from nibble.models.convert import linears_to_convert

    model = tiny_model()
    names = linears_to_convert(model, QuantConfig())
    assert len(names) == 14 and "lm_head" not in names
    names = linears_to_convert(model, QuantConfig(modules_to_not_convert=["mlp.down_proj"]))
    assert len(names) == 13 and names[-1] == "lm_head" and not any(n.endswith("down_proj") for n in names)
    # a suffix is whole dotted names: "1.mlp.down_proj" is layer 1's alone, not layer 11's; "head" is not lm_head
    model = tiny_model(num_hidden_layers=12)
    names = linears_to_convert(model, QuantConfig(modules_to_not_convert=["1.mlp.down_proj", "head"]))
    assert len(names) == 12 * 7 and "model.layers.1.mlp.down_proj" not in names
    assert "model.layers.11.mlp.down_proj" in names and names[-1] == "lm_head"


def test_a_skip_entry_naming_a_module_keeps_its_linears_in_16_bits():
    """'model.layers.1' matched no linear by the old suffix rule: a warning, and the layer was quantized (lm_head
    too, the given list replacing the default)."""
    from nibble.models.convert import linears_to_convert

    model = tiny_model(num_hidden_layers=12)
    names = linears_to_convert(model, QuantConfig(modules_to_not_convert=["lm_head", "model.layers.1", "layers.2.mlp"]))
    assert not any(n.startswith(("model.layers.1.", "model.layers.2.mlp.")) for n in names)
    assert len(names) == 12 * 7 - 7 - 3 and "model.layers.2.self_attn.q_proj" in names
    assert "model.layers.10.mlp.down_proj" in names and "lm_head" not in names  # a whole part: not layers.10


def test_a_skip_entry_that_matches_nothing_warns():
    with pytest.warns(UserWarning, match=r"\['dwn_proj'\] match no linear"):
        quantize_model(tiny_model(), QuantConfig(group_size=32, modules_to_not_convert=["lm_head", "dwn_proj"]),
                       progress=False)


@pytest.mark.parametrize("mode,rotation", [("w4a16", "none"), ("w4a4", "none"), ("w4a4", "hadamard")])
def test_a_converted_model_compiles_into_one_graph(monkeypatch, mode, rotation):
    """A converted model, its online rotations included, compiles whole with fullgraph=True (any graph
    break fails it) and gives the eager logits. On the CPU the kernel dispatch is forced, so nibble's
    custom ops (whose CPU bodies are the reference) are what gets traced."""
    from nibble import kernels
    monkeypatch.setattr(kernels, "_use_kernel", lambda x, backend: True)
    model = tiny_model(dtype=torch.bfloat16)
    config = QuantConfig(mode=mode, rotation=rotation) if mode == "w4a4" else QuantConfig(mode=mode, group_size=32)
    quantize_model(model, config, progress=False)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, backend="eager")(ids).logits
        assert torch.equal(compiled, model(ids).logits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="transformers compiles a static-cache decode on a GPU only")
@pytest.mark.parametrize("mode,min_cos", [("w4a16", 0.999), ("w4a4", 0.95)])
def test_gpu_static_cache_generate_compiles_the_quantized_layers(mode, min_cos):
    """transformers' own fast decode, ``generate(cache_implementation="static")``, runs each step as a
    torch.compile'd graph (CUDA graphs): nibble's layers trace into it as custom ops, without a graph
    break, and each step's logits are an eager forward's over the same tokens (teacher-forced, so a
    near-tie that tips one token cannot derail the comparison; W4A4's activation codes amplify the
    rounding differences between the compiled step and the eager pass: cosine 0.985 at worst on the
    CPU, through the reference)."""
    from torch._dynamo.utils import counters

    model = tiny_model(dtype=torch.bfloat16, hidden_size=256, intermediate_size=512).cuda()
    quantize_model(model, QuantConfig(mode=mode), progress=False)
    ids = torch.randint(1, 256, (1, 7), generator=torch.Generator().manual_seed(0)).cuda()
    counters.clear()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static",
                             output_logits=True, return_dict_in_generate=True)
    assert counters["stats"]["unique_graphs"] >= 1, "the decode step was not compiled"
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    # Dynamo warned of the dispatch's lru_cache at every compile (session 71; a user sees it too)
    dynamo_said = [str(w.message) for w in said if f"{os.sep}_dynamo{os.sep}" in w.filename]
    assert not dynamo_said, dynamo_said
    with torch.no_grad():
        eager = model(out.sequences[:, :-1]).logits[0, ids.shape[1] - 1:].float()
    steps = torch.stack(out.logits, 1)[0].float()
    cos = nn.functional.cosine_similarity(steps, eager, dim=-1)
    assert cos.min() >= min_cos, f"compiled decode steps against the eager forward: cosine {cos.tolist()}"


# ---- quantize_model(device=...): a model in host memory quantized onto the GPU one layer at a time ------
DEVICE_CONFIGS = [  # (QuantConfig kwargs, with calibration)
    (dict(mode="w4a16", group_size=32), False),
    (dict(mode="w4a4", rotation="hadamard"), False),
    (dict(mode="w4a16", group_size=32, method="gptq"), True),
    (dict(mode="w4a16", group_size=32, method="awq"), True),
    (dict(mode="w4a4", rotation="hadamard", method="gptq"), True),
    (dict(mode="w4a16", group_size=32, modules_to_not_convert=[]), False),  # lm_head quantized too
]


def _quantize_both_ways(arch, kwargs, calibrated, dtype, device):
    """The same random model quantized as it stands on ``device`` and from host memory with ``device=``."""
    torch.manual_seed(1)
    host = tiny_model(arch, dtype=dtype, num_hidden_layers=3)
    on_device = tiny_model(arch, dtype=dtype, num_hidden_layers=3).to(device)
    on_device.load_state_dict(host.state_dict())
    calib = torch.randint(0, 256, (6, 24), generator=torch.Generator().manual_seed(3)) if calibrated else None
    quantize_model(on_device, QuantConfig(**kwargs), progress=False, calibration=calib)
    quantize_model(host, QuantConfig(**kwargs), progress=False, calibration=calib, device=device)
    return on_device, host


def _assert_same_model(a, b, device):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sb[k].device.type == torch.device(device).type, k
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert [type(m) for m in a.modules()] == [type(m) for m in b.modules()]
    ids = torch.randint(0, 256, (2, 10), device=device)
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


@pytest.mark.parametrize("kwargs,calibrated", DEVICE_CONFIGS)
def test_quantizing_through_the_device_argument_equals_quantizing_in_place(kwargs, calibrated):
    """On the CPU the layers do not move, but the walk is the one that moves them (every config's path)."""
    a, b = _quantize_both_ways("llama", kwargs, calibrated, torch.float32, "cpu")
    _assert_same_model(a, b, "cpu")


@pytest.mark.parametrize("kwargs,calibrated", DEVICE_CONFIGS)
def test_one_decoder_layer_at_a_time_is_rotated_or_calibrated_and_then_quantized(kwargs, calibrated, monkeypatch):
    """Whenever a linear is converted or a down_proj rotated, the decoder layers read: quantized, then at most
    one in the works (rotated, calibrated, half converted), then untouched. So the 16-bit copies that rotation
    and GPTQ / AWQ write never pile up: a model loaded from safetensors (a mapping of its files) keeps them
    out of host memory, and on a GPU the weights that came from host memory stay one layer."""
    from nibble.nn.hadamard import HadamardInputLinear
    torch.manual_seed(2)
    model = tiny_model("llama", num_hidden_layers=4)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    layers = model.model.layers
    checks = []

    def state(i, layer):
        linears = [m for m in layer.modules() if isinstance(m, (nn.Linear, QuantLinear))]
        if all(isinstance(m, QuantLinear) for m in linears):
            return "quantized"
        untouched = not any(isinstance(m, (QuantLinear, HadamardInputLinear)) for m in linears) and all(
            torch.equal(v, original[f"model.layers.{i}.{k}"]) for k, v in layer.state_dict().items())
        return "untouched" if untouched else "in the works"

    def check():
        states = [state(i, layer) for i, layer in enumerate(layers)]
        order = {"quantized": 0, "in the works": 1, "untouched": 2}
        assert states == sorted(states, key=order.get) and states.count("in the works") <= 1, states
        checks.append(states)

    def spy(cls, name):
        real = getattr(cls, name).__func__
        monkeypatch.setattr(cls, name, classmethod(lambda c, *a, **k: (check(), real(c, *a, **k))[1]))
    spy(QuantLinear, "from_linear")
    spy(QuantLinear, "from_weight")
    spy(HadamardInputLinear, "from_linear")
    calib = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(3)) if calibrated else None
    quantize_model(model, QuantConfig(**kwargs), progress=False, calibration=calib, device="cpu")
    check()
    assert checks[-1] == ["quantized"] * 4 and len(checks) > 4 * 7
    assert any(states.count("untouched") == 3 for states in checks)  # the first layer's turn was seen
    # ... and one of those mid-layer: rotated or calibrated, not yet converted
    assert any("in the works" in states for states in checks)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_the_layer_turns_leave_the_calibrated_quantizer_no_copy_of_its_results(monkeypatch, method):
    """Each QuantLinear copies its calibrated Int4Weight; the quantizer's returned dict gathers every layer's
    results after its turn, so the turns take them out as they convert: otherwise a GPU quantizing from host
    memory keeps a second copy of every quantized weight until the end (the GPU memory test below found it)."""
    import nibble.quantize as quantizers
    returned = []
    quantizer = quantizers.calibrated_quantizers[method]
    monkeypatch.setitem(quantizers.calibrated_quantizers, method,
                        lambda *args, **kwargs: returned.append(quantizer(*args, **kwargs)))
    model = tiny_model(num_hidden_layers=3)
    quantize_model(model, QuantConfig(group_size=32, method=method), progress=False,
                   calibration=torch.randint(0, 256, (4, 16)))
    assert len([m for m in model.modules() if isinstance(m, QuantLinear)]) == 3 * 7
    assert returned == [{}]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no GPU is visible")
def test_a_device_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        quantize_model(tiny_model(), QuantConfig(group_size=32), progress=False, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to quantize onto")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kwargs,calibrated", DEVICE_CONFIGS)
def test_gpu_a_model_in_host_memory_quantized_onto_the_gpu_equals_one_quantized_there(arch, kwargs, calibrated):
    """Every tensor ends on the GPU, equal bit for bit to quantizing the model after moving it there whole."""
    a, b = _quantize_both_ways(arch, kwargs, calibrated, torch.bfloat16, "cuda")
    _assert_same_model(a, b, "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to quantize onto")
@pytest.mark.parametrize("kwargs,calibrated", DEVICE_CONFIGS[:3])
def test_gpu_quantizing_from_host_memory_never_holds_the_16_bit_layers(kwargs, calibrated):
    """From host memory the GPU's peak grows with the model's depth by the quantized layers only: twice the
    decoder layers add less than half their 16-bit bytes to it, where the model moved whole first adds them
    all. (Differences of depth: what the peak holds besides, GPTQ's work, is the same at every depth.)"""
    calib = torch.randint(0, 512, (2, 16)) if calibrated else None

    def peak(layers: int, from_host: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        model = tiny_model("llama", dtype=torch.bfloat16, num_hidden_layers=layers, hidden_size=256,
                           intermediate_size=768, vocab_size=512)
        layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        quantize_model(model if from_host else model.to("cuda"), QuantConfig(**kwargs), progress=False,
                       calibration=calib, device="cuda" if from_host else None)
        torch.cuda.synchronize()
        assert all(t.is_cuda for t in model.state_dict().values())
        return torch.cuda.max_memory_allocated() - before, layer_bytes

    peak(4, True)  # allocates what stays for the process (cuBLAS's workspaces), not the model's
    (host_12, bytes_12), (host_24, bytes_24) = peak(12, True), peak(24, True)
    (whole_12, _), (whole_24, _) = peak(12, False), peak(24, False)
    added = bytes_24 - bytes_12
    assert host_24 - host_12 < added / 2, (host_12, host_24, added)
    assert whole_24 - whole_12 >= added, (whole_12, whole_24, added)  # the way that holds them all tells apart


@pytest.mark.parametrize("kwargs", [{}, dict(zero_point="float"), dict(symmetric=True), dict(clip_search=True),
                                    dict(mode="w4a4")])
def test_a_group_of_zero_weights_leaves_the_output_finite(kwargs):
    """One all-zero group (pruned or padded weights) once gave a NaN zero point under the default W4A16 RTN,
    and the NaN every logit."""
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 12))
    down = model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        down.weight[3, :32] = 0
        down.weight[7] = 0  # a whole row: W4A4's per-channel group
    config = QuantConfig(**kwargs) if "mode" in kwargs else QuantConfig(group_size=32, **kwargs)
    quantize_model(model, config, progress=False)
    q = model.model.layers[0].mlp.down_proj
    assert torch.isfinite(q.scales).all() and torch.isfinite(q.zeros).all()
    dense = dequantize(q.qweight, q.scales, q.zeros, q.group_size)
    assert torch.equal(dense[7], torch.zeros(dense.shape[1]))
    if q.group_size == 32:
        assert torch.equal(dense[3, :32], torch.zeros(32))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_a_weight_float16_scales_cannot_hold_is_refused_by_layer_name():
    model = tiny_model()
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[5, 9] = 1e6
    with pytest.raises(ValueError, match=r"^model\.layers\.1\.self_attn\.o_proj: weights up to \|w\| = 1e\+06 .*"
                                         "float16's range"):
        quantize_model(model, QuantConfig(group_size=32), progress=False)


def test_quantizing_a_quantized_model_again_is_refused():
    """A second quantize_model once left a config saying one mode over layers of another, which no load read back."""
    model = tiny_model()
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    for config in (QuantConfig(mode="w4a4"), QuantConfig(group_size=32)):
        with pytest.raises(ValueError, match="quantized already: 14 of its linears are QuantLinear.*load the 16-bit "
                                             "model again"):
            quantize_model(model, config, progress=False)
    assert model.config.quantization_config["mode"] == "w4a16"
    assert {m.mode for m in model.modules() if isinstance(m, QuantLinear)} == {"w4a16"}
    fresh = tiny_model()
    fresh.config.quantization_config = {"quant_method": "gptq", "bits": 4}  # as transformers loads a GPTQ model
    with pytest.raises(ValueError, match="quantization_config \\(quant_method 'gptq'\\).*load the 16-bit model again"):
        quantize_model(fresh, QuantConfig(group_size=32), progress=False)


def test_quantizing_a_model_leaves_another_of_the_same_config_object_as_it_was(tmp_path):
    """Models built from one config object share it: quantizing one marked the other as quantized (refused by
    quantize_model) and untied its head in its config alone."""
    from transformers import LlamaForCausalLM
    from conftest import tiny_config
    from nibble import load_quantized, save_quantized
    config = tiny_config()
    model, other = LlamaForCausalLM(config).eval(), LlamaForCausalLM(config).eval()
    quantize_model(model, QuantConfig(group_size=32, modules_to_not_convert=[]), progress=False)
    assert not hasattr(config, "quantization_config") and config.tie_word_embeddings
    assert all(m.config is model.config for m in model.modules() if hasattr(m, "config"))
    save_quantized(model, tmp_path)
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(load_quantized(tmp_path)[0](ids).logits, model(ids).logits)
    quantize_model(other, QuantConfig(mode="w4a4"), progress=False)
    assert (model.config.quantization_config["mode"], other.config.quantization_config["mode"]) == ("w4a16", "w4a4")


def test_the_decoder_layers_are_found_and_replaced_in_one_place(monkeypatch):
    """Calibration (its stand-in layers) and a quantization onto a device (the layers out of the tree while the rest
    moves) each set model.model.layers themselves, beside decoder_layers, which finds them: a model whose layers live
    elsewhere would be walked in one place and replaced in another."""
    import nibble.models.architecture as architecture
    import nibble.models.convert as convert
    import nibble.quantize.calibration as calibration
    model, replaced = tiny_model(), []
    layers = architecture.decoder_layers(model)

    def replacing(model, stand_in):
        replaced.append(len(stand_in))
        return real(model, stand_in)
    real = architecture.decoder_layers_replaced
    for module in (convert, calibration):  # the two that replace the layers, each with architecture's function
        monkeypatch.setattr(module, "decoder_layers_replaced", replacing)
    quantize_model(model, QuantConfig(group_size=32, method="gptq"), calibration=torch.randint(0, 256, (2, 16)),
                   device="cpu", progress=False)
    assert replaced == [0, 2] and architecture.decoder_layers(model) is layers  # the move's empty list, then 2 stand-ins


def test_modules_to_not_convert_given_as_one_name_keeps_that_module():
    """A string was once read as its characters, none of which matched lm_head, which then got quantized."""
    model = tiny_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the characters also warned of entries matching nothing
        quantize_model(model, QuantConfig(group_size=32, modules_to_not_convert="lm_head"), progress=False)
    assert type(model.lm_head) is nn.Linear
    assert model.config.quantization_config["modules_to_not_convert"] == ["lm_head"]


def test_a_width_the_group_size_refuses_is_said_before_any_layer_is_converted():
    """A down_proj of 192 inputs refused group_size=128 after six linears of layer 0 were converted: the model
    was half quantized, and quantizing it again with 64 was refused as quantized already."""
    model = tiny_model("llama", hidden_size=128, intermediate_size=192)
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.mlp\.down_proj: in_features=192 is not divisible by "
                                         r"group_size=128; pick a group size that divides it: 64 or 32 \(CUDA "
                                         r"kernels\), 96 \(Triton\), or -1 for per-channel; group_size=64 divides "
                                         r"every layer's \(what `nibble quantize` picks for this model"):
        quantize_model(model, QuantConfig(group_size=128), progress=False)
    assert not quantized_linears(model)
    quantize_model(model, QuantConfig(group_size=64), progress=False)
    assert len(quantized_linears(model)) == 14


def test_calibration_for_rtn_is_refused_not_ignored():
    """RTN calibrates nothing: the ids were dropped without a word, and a user who forgot method="gptq" believed the
    model calibrated (the CLI refused the same thing)."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="calibration was given for method='rtn', which calibrates nothing"):
        quantize_model(model, QuantConfig(group_size=32), progress=False, calibration=torch.randint(0, 256, (4, 16)))
    assert not quantized_linears(model)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibration_ids_outside_the_vocabulary_are_refused_first(method):
    model = tiny_model("llama")  # 256 tokens
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = QuantConfig(group_size=32, method=method, rotation="none")
    # none at all is told how to make them, not that None is no integer tensor
    with pytest.raises(ValueError, match=f"method='{method}' needs calibration token ids: pass calibration=nibble."
                                         "quantize.calibration.calibration_for"):
        quantize_model(model, cfg, progress=False)
    with pytest.raises(ValueError, match="calibration token ids run from 0 to 999, but the model's vocabulary has "
                                         "256 tokens: make them with this model's tokenizer"):
        quantize_model(model, cfg, progress=False, calibration=torch.arange(1000).reshape(10, 100))
    # floats, complex too; an attention mask, which GPTQ took; one window unbatched (an IndexError of shape[1]); no rows
    for wrong in (torch.rand(4, 16), torch.randn(4, 16, dtype=torch.complex64), torch.rand(4, 16) > 0.5,
                  torch.randint(0, 256, (64,)), torch.randint(0, 256, (0, 16))):
        with pytest.raises(ValueError, match="calibration must be token ids"):
            quantize_model(model, cfg, progress=False, calibration=wrong)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibration_that_cannot_calibrate_is_refused_and_too_little_warned_of(method):
    """GPTQ and AWQ took windows of one token, and windows past the model's context, without a word, and returned a
    "calibrated" model; fewer tokens than a layer has inputs calibrate it on singular statistics: a warning."""
    model = tiny_model("llama")  # a context of 256, layers of up to 192 inputs (down_proj)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = QuantConfig(group_size=32, method=method)
    with pytest.raises(ValueError, match="calibration windows of seq_len=1 show the model position 0 alone"):
        quantize_model(model, cfg, progress=False, calibration=torch.zeros(200, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"calibration windows of seq_len=300 exceed the model's context \(256 = "
                                         r"config.max_position_embeddings\)"):
        quantize_model(model, cfg, progress=False, calibration=torch.zeros(1, 300, dtype=torch.long))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.warns(UserWarning, match="calibration of 64 tokens is fewer than the 192 inputs of the model's widest "
                                         "layer") as caught:
        quantize_model(model, cfg, progress=False, calibration=torch.randint(0, 256, (4, 16)))
    assert len(caught) == 1 and caught[0].filename == __file__  # once, at the user's line, not nibble's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_model(tiny_model("llama"), cfg, progress=False, calibration=torch.randint(0, 256, (2, 96)))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_the_calibrated_quantizers_called_directly_check_their_calibration_as_quantize_model_does(method):
    """gptq_quantize_model / awq_quantize_model took windows of one token, or past the model's context, and too few
    tokens without a word (quantize_model refused or warned of them before it called them)."""
    from nibble.quantize import calibrated_quantizers

    quantize = calibrated_quantizers[method]
    model = tiny_model("llama")  # a context of 256, layers of up to 192 inputs (down_proj)
    cfg = QuantConfig(group_size=32, method=method)
    with pytest.raises(ValueError, match="calibration windows of seq_len=1 show the model position 0 alone"):
        quantize(model, cfg, torch.zeros(200, 1, dtype=torch.long), progress=False)
    with pytest.raises(ValueError, match=r"calibration windows of seq_len=300 exceed the model's context \(256"):
        quantize(model, cfg, torch.zeros(1, 300, dtype=torch.long), progress=False)
    with pytest.raises(ValueError, match="calibration token ids run from 0 to 999"):
        quantize(model, cfg, torch.arange(1000).reshape(10, 100), progress=False)
    with pytest.warns(UserWarning, match="calibration of 64 tokens is fewer than the 192 inputs") as caught:
        quantize(model, cfg, torch.randint(0, 256, (4, 16)), progress=False)
    assert len(caught) == 1 and caught[0].filename == __file__


def test_what_transformers_would_leave_half_done_is_refused_first():
    """resize_token_embeddings resized the embedding, then failed on a quantized head ("no attribute 'weight'");
    an empty (meta) model failed in the quantizer on "Tensor.item() cannot be called on meta tensors"."""
    model = tiny_model("llama")
    quantize_model(model, QuantConfig(group_size=32, modules_to_not_convert=[]), progress=False)
    rows = model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match="lm_head is quantized .* of the 16-bit model, then quantize it"):
        model.resize_token_embeddings(rows + 16)
    assert model.get_input_embeddings().num_embeddings == rows
    with torch.device("meta"):
        empty = tiny_model("llama")
    with pytest.raises(ValueError, match="on the meta device .* load its weights first"):
        quantize_model(empty, QuantConfig(group_size=32), progress=False)


NOT_FINITE = "weight contains NaN or Inf; fix the checkpoint"


# GPTQ and AWQ change a weight before its scales are taken: only its turn can tell whether float16 holds them
@pytest.mark.parametrize("value, refusal, method, device", [
    *[(v, NOT_FINITE, m, d) for v in (float("nan"), float("-inf"))
      for m, d in (("rtn", None), ("rtn", "cpu"), ("gptq", None), ("awq", "cpu"))],
    *[(1e6, r"weights up to \|w\| = 1e\+06 need a scale or zero point", "rtn", d) for d in (None, "cpu")]])
def test_a_weight_rtn_would_refuse_is_said_before_any_layer_is_converted(value, refusal, method, device):
    """A NaN / Inf weight, or one float16's scales cannot hold, in layer 1 was found at its turn: layer 0 was
    converted by then, and a retry after fixing the weight was refused as quantized already."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 7] = value
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = QuantConfig(group_size=32, method=method)
    calibration = None if method == "rtn" else torch.randint(0, 256, (2, 8))
    with pytest.raises(ValueError, match=rf"^model\.layers\.1\.mlp\.down_proj: {refusal}"):
        quantize_model(model, config, progress=False, calibration=calibration, device=device)
    assert not quantized_linears(model) and getattr(model.config, "quantization_config", None) is None
    after = model.state_dict()
    for k, v in before.items():  # every weight as it was, the NaN included (NaN != NaN for torch.equal)
        torch.testing.assert_close(after[k], v, rtol=0, atol=0, equal_nan=True, msg=k)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 7] = 0.01
    quantize_model(model, config, progress=False, calibration=calibration, device=device)
    assert len(quantized_linears(model)) == 14


def test_a_weight_the_rotation_brings_within_float16_scales_is_not_refused_before_it():
    """check_weights checks the float16 scales of a weight as RTN will quantize it: with rotation='hadamard' it is
    rotated first. One entry of 1e5 in a row of 64 needs a scale float16 cannot hold, and is refused unrotated; the
    rotation spreads it over the row (1e5 / 8 each), and the model quantizes."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[3, 7] = 1e5
    with pytest.raises(ValueError, match=r"^model\.layers\.1\.self_attn\.q_proj: weights up to \|w\| = 1e\+05 need"):
        quantize_model(model, QuantConfig(mode="w4a4"), progress=False)
    quantize_model(model, QuantConfig(mode="w4a4", rotation="hadamard"), progress=False)
    assert torch.isfinite(model.model.layers[1].self_attn.q_proj.scales).all()


def test_a_symmetric_config_refuses_a_float_zero_point_it_would_ignore():
    """Symmetric weights have no zero point: zero_point='float' was ignored (the same weights as 'int') and the
    checkpoint's quantization_config said 'float'. Configs saved so still load, as what their weights are."""
    for kwargs in (dict(mode="w4a16", symmetric=True), dict(mode="w4a4")):
        with pytest.raises(ValueError, match=r"zero_point='float' \(CLI --float-zero: a float minimum per group\) is "
                                             r"for asymmetric w4a16 weights; symmetric ones .* have no zero point"):
            QuantConfig(zero_point="float", **kwargs)
    assert QuantConfig(zero_point="float").zero_point == "float"  # asymmetric w4a16
    saved = {**QuantConfig(mode="w4a4").to_dict(), "zero_point": "float"}
    assert QuantConfig.from_dict(saved) == QuantConfig(mode="w4a4")


def test_a_rotated_model_is_refused_a_mode_that_cannot_run_its_online_hadamard_before_any_layer_is_converted():
    """A rotated model's down_proj rotates its input online, which only W4A4 runs: W4A16 was refused at layer 0's
    down_proj, after its other six linears were converted, and a retry refused the model as quantized already."""
    from nibble.models.rotation import rotate_model
    model = rotate_model(tiny_model("llama"))
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.mlp\.down_proj rotates its input online .* only w4a4 "
                                         r"runs: quantize the model with mode='w4a4', or keep those layers"):
        quantize_model(model, QuantConfig(group_size=32), progress=False)
    with pytest.raises(ValueError, match=re.escape("modules_to_not_convert=['q_proj', 'lm_head', 'down_proj']")):
        quantize_model(model, QuantConfig(group_size=32, modules_to_not_convert=["q_proj"]), progress=False)
    assert not quantized_linears(model) and getattr(model.config, "quantization_config", None) is None
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
        quantize_model(model, QuantConfig(group_size=32, modules_to_not_convert=["lm_head", "down_proj"]),
                       progress=False)  # its down_projs kept in 16 bits, with their online Hadamard
        got = model(ids).logits
    assert len(quantized_linears(model)) == 12
    assert nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0) > 0.99


def test_set_backend_refuses_an_unknown_backend_at_the_call_naming_the_valid_ones():
    """set_backend(model, "bogus") was taken, and the next forward failed far from the call that set it."""
    from nibble.models.convert import set_backend

    model = tiny_model()
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'reference', 'triton'\), got 'cuda'"):
        set_backend(model, "cuda")
    assert {m.backend for _, m in quantized_linears(model)} == {"auto"}  # untouched
    set_backend(model, "reference")
    assert {m.backend for _, m in quantized_linears(model)} == {"reference"}
    with pytest.raises(ValueError, match=r"backend must be one of"):  # a model without QuantLinears too
        set_backend(tiny_model(), "triton ")


@pytest.mark.parametrize("offload", ["disk", "cpu"])
def test_a_model_accelerate_offloads_is_refused_as_offloaded_not_as_empty(tmp_path, offload):
    """A model whose layers accelerate offloaded (device_map "disk", or cpu_offload) was told to load its weights,
    which it had: they wait on the meta device for its hooks."""
    accelerate = pytest.importorskip("accelerate")  # peft's dependency (the qat extra)

    model = tiny_model("llama")
    if offload == "disk":
        device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                      "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
        accelerate.dispatch_model(model, device_map=device_map, offload_dir=tmp_path)
    else:
        accelerate.cpu_offload(model, execution_device="cpu")
    with pytest.raises(ValueError, match=r"^the model's weights are offloaded \(a device_map with 'cpu' or 'disk' .* "
                                         "load the model without a device_map, into host memory"):
        quantize_model(model, QuantConfig(group_size=32), progress=False)


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.float64), lambda m: m.double(), lambda m: m.type(torch.float64)])
def test_a_cast_to_a_dtype_the_model_cannot_run_in_is_refused_before_any_module_is_cast(tmp_path, cast):
    """``model.to(torch.float64)`` went through, and the model failed at its first forward; a QuantLinear's own
    refusal alone came after the embedding, before it in the walk, was cast. A copy and a loaded model refuse too."""
    from nibble import load_quantized, save_quantized

    model = tiny_model("qwen2")
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        want = model(ids).logits
    for held in (model, copy.deepcopy(model), load_quantized(save_quantized(model, tmp_path), tokenizer=False)[0]):
        with pytest.raises(TypeError, match=r"^a quantized model runs in torch\.float16, torch\.bfloat16 or "
                                            r"torch\.float32 .*, not torch\.float64"):
            cast(held)
        assert {t.dtype for t in held.state_dict().values() if t.is_floating_point()} == {torch.float32, torch.float16}
        with torch.no_grad():
            assert torch.equal(held(ids).logits, want)
    assert model.half().model.embed_tokens.weight.dtype == torch.float16  # the dtypes it runs in still cast


def _codes(qweight):
    """The [K, N] 4-bit codes of a canonical qweight (row k = 8i + j in bits 4j of word i), unpacked here."""
    return ((qweight.unsqueeze(1) >> torch.arange(0, 32, 4).view(1, 8, 1)) & 0xF).reshape(-1, qweight.shape[1])


class _ReferenceLinear(nn.Module):
    """A QuantLinear's function written out: y = x' @ W.T + b, W = q * s + z from its buffers (float64); for W4A4 x' is
    x after the online Hadamard (Sylvester's, power-of-two sizes), rounded to x's dtype and fake-quantized per token:
    round(x / s) * s, s = amax|x| / 7."""

    def __init__(self, q: QuantLinear):
        super().__init__()
        g = q.group_size
        self.w = (_codes(q.qweight).double() * q.scales.double().repeat_interleave(g, 0)
                  + q.zeros.double().repeat_interleave(g, 0)).t()
        self.b, self.mode, self.hadamard = q.bias, q.mode, q.input_hadamard

    def forward(self, x):
        xd = x.double()
        if self.hadamard:
            h = torch.ones(1, 1, dtype=torch.float64)
            while h.shape[0] < x.shape[-1]:
                h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
            assert h.shape[0] == x.shape[-1]
            xd = (xd @ h.t() / h.shape[0] ** 0.5).to(x.dtype).double()
        if self.mode == "w4a4":
            s = (xd.abs().amax(-1, keepdim=True).float() / 7).double()
            xd = torch.where(s > 0, torch.round(xd / torch.where(s > 0, s, 1)), 0) * s
        y = xd @ self.w.t() + (0 if self.b is None else self.b.double())
        return y.to(x.dtype)


REFERENCE_CASES = [  # (family, config overrides, the model's dtype, QuantConfig)
    ("llama", dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True), torch.float32,
     QuantConfig(group_size=32)),
    ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}), torch.float32,
     QuantConfig(group_size=64, symmetric=True)),
    ("llama", dict(hidden_size=128, intermediate_size=256, head_dim=64), torch.float32, QuantConfig(group_size=128)),
    ("llama", dict(intermediate_size=96), torch.bfloat16, QuantConfig(group_size=32)),  # 96: no multiple of 64
    ("llama", dict(intermediate_size=200), torch.float32, QuantConfig(group_size=-1)),  # 200: of no group but 8, 40
    ("qwen2", {}, torch.float32, QuantConfig(mode="w4a4")),
    ("qwen2", dict(intermediate_size=256), torch.float16,
     QuantConfig(mode="w4a4", rotation="hadamard", rotation_seed=3)),
    ("mistral", dict(intermediate_size=256, sliding_window=4), torch.float32,
     QuantConfig(mode="w4a4", rotation="hadamard", modules_to_not_convert=[])),
]


@pytest.mark.parametrize("arch, overrides, dtype, config", REFERENCE_CASES)
def test_a_converted_model_is_its_float_model_with_each_linear_computed_from_its_int4_weights(tmp_path, arch, overrides,
                                                                                              dtype, config):
    """Whole-model conversion against a reference written here: the float model (rotated by rotate_model where the
    config rotates) with each converted linear replaced by `_ReferenceLinear` of its QuantLinear; then saved, loaded
    and run again, logits and greedy tokens the same."""
    from nibble import load_quantized, save_quantized
    from nibble.models.rotation import rotate_model

    model = tiny_model(arch, dtype=dtype, **overrides)
    reference = copy.deepcopy(model)
    quantize_model(model, config, progress=False)
    if config.rotation == "hadamard":
        rotate_model(reference, config.rotation_seed)
    converted = quantized_linears(model)
    assert len(converted) == 14 + ("lm_head" not in config.modules_to_not_convert)
    for name, q in converted:
        parent, _, child = name.rpartition(".")
        setattr(reference.get_submodule(parent), child, _ReferenceLinear(q))
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    # 16-bit: a rounding may move a code by a step; in W4A4 an activation's step is 1/7 of its token's largest value,
    # and attention spreads it (2.3% of a down_proj's output, 1.5% of the logits, on torch 2.11's tiny qwen2 here)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2 if config.mode == "w4a4" else 1e-2
    assert got.dtype == dtype and (got.float() - want.float()).abs().max() <= tolerance * want.abs().max()
    loaded, _ = load_quantized(save_quantized(model, tmp_path), tokenizer=False)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, got)
    prompt = ids[:1, :4]
    assert torch.equal(loaded.generate(prompt, max_new_tokens=8, do_sample=False),
                       model.generate(prompt, max_new_tokens=8, do_sample=False))


def test_skips_that_leave_no_linear_to_quantize_are_refused_before_the_model_is_touched():
    """The model came back marked quantized, every linear still 16-bit, and a second try was refused as quantized."""
    model = tiny_model("llama")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    with pytest.raises(ValueError, match=r"^modules_to_not_convert=\['q_proj', .*\] leaves none of the model's 15 "
                                         "linears to quantize"):
        quantize_model(model, QuantConfig(group_size=32, modules_to_not_convert=every), progress=False)
    assert getattr(model.config, "quantization_config", None) is None and not quantized_linears(model)
    quantize_model(model, QuantConfig(group_size=32, modules_to_not_convert=every[1:]), progress=False)
    assert [n for n, _ in quantized_linears(model)] == [f"model.layers.{i}.self_attn.q_proj" for i in (0, 1)]


def test_untying_the_head_gives_it_a_table_of_its_own():
    """untie_lm_head copies the embedding's table into lm_head: a Parameter over the same storage left them one
    tensor, so a change to the head alone (a rotation in place on a GPU) changed the embedding too. The copy is
    as trainable as the table was: a frozen embedding does not become a trainable head."""
    from nibble.models.convert import lm_head_tied, untie_lm_head

    model = tiny_model("llama")
    embed = model.model.embed_tokens.weight.detach().clone()
    model.model.embed_tokens.weight.requires_grad_(False)
    untie_lm_head(model)
    assert not lm_head_tied(model) and not model.config.tie_word_embeddings
    assert not model.lm_head.weight.requires_grad
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert torch.equal(model.lm_head.weight, 2 * embed)


def test_a_head_sharing_the_embeddings_storage_through_another_parameter_is_tied():
    """load_state_dict(assign=True) of a tied model (one tensor under both names) gives the head and the embedding a
    Parameter each over one storage: still one table, held once, so a quantized head records the tie."""
    from nibble.models.convert import lm_head_tied

    model = tiny_model("llama")
    model.load_state_dict(model.state_dict(), assign=True)
    assert model.lm_head.weight is not model.model.embed_tokens.weight and lm_head_tied(model)
    quantize_model(model, QuantConfig(group_size=32, modules_to_not_convert=[]), progress=False)
    assert model.config.quantization_config["lm_head_was_tied"] is True


@pytest.mark.parametrize("config", [QuantConfig(group_size=32), QuantConfig(mode="w4a4", rotation="hadamard")])
def test_each_of_eleven_decoder_layers_is_converted_at_its_own_turn(config, monkeypatch):
    """A layer's turn converts the linears under "model.layers.{i}.", whole dotted part: layer 1's turn must not take
    layer 10's, which would be converted before its own turn rotated (or moved, or calibrated) it."""
    from nibble.models import convert

    model = tiny_model("llama", num_hidden_layers=11)
    converted = []
    real = convert._convert
    monkeypatch.setattr(convert, "_convert", lambda m, name, *a: (converted.append(name), real(m, name, *a))[1])
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        want = model(ids).logits
        got = quantize_model(model, config, progress=False)(ids).logits
    assert converted == convert.linears_to_convert(tiny_model("llama", num_hidden_layers=11), config)
    assert nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0) > 0.9


@pytest.mark.parametrize("name,method,group_size", [
    ("lm_head", "gptq", 32),  # quantized by RTN whatever the method: its scales are checked up front too
    ("model.layers.1.mlp.down_proj", "rtn", -1),  # per channel: the group is the whole row
])
def test_a_weight_float16_scales_cannot_hold_is_refused_up_front_for_every_layer_rtn_quantizes(name, method,
                                                                                               group_size):
    """check_weights checks the scales of the layers RTN quantizes as they are (lm_head under GPTQ / AWQ too) in
    the groups they will have (per channel: one of in_features); found at the head's turn, the decoder layers were
    converted by then."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.get_submodule(name).weight[3, 7] = 1e6
    calibration = None if method == "rtn" else torch.randint(0, 256, (2, 8))
    config = QuantConfig(group_size=group_size, method=method, modules_to_not_convert=[])
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}: weights up to \|w\| = 1e\+06 need a scale"):
        quantize_model(model, config, progress=False, calibration=calibration)
    assert not quantized_linears(model) and getattr(model.config, "quantization_config", None) is None


def test_a_gptq_quantized_rotated_layer_keeps_its_online_hadamard():
    """GPTQ's Int4Weight holds no rotation: the QuantLinear made of it takes the online Hadamard from the layer it
    replaces (down_proj, and o_proj after online_o_proj), else it ran the rotated weight on the unrotated input."""
    from nibble.models.rotation import rotate_model

    model = rotate_model(tiny_model("llama", num_hidden_layers=1), seed=2, online_o_proj=True)
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        want = model(ids).logits
        quantize_model(model, QuantConfig(mode="w4a4", method="gptq"), progress=False,
                       calibration=torch.randint(0, 256, (2, 32)))
        got = model(ids).logits
    online = [n for n, m in quantized_linears(model) if m.input_hadamard]
    assert online == ["model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"]
    assert nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0) > 0.9


def test_a_bias_made_a_parameter_is_counted_once():
    """transformers' num_parameters counts a QuantLinear bias that is a Parameter (one a user made trainable)
    itself: the quantized weights' count adds only the biases held as buffers."""
    model = tiny_model("qwen2")  # biases on q/k/v
    before = model.num_parameters()
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.bias = nn.Parameter(q_proj.bias.clone())
    assert model.num_parameters() == before


def test_quantizing_onto_a_device_moves_each_decoder_layer_at_its_turn(monkeypatch):
    """device=: everything but the decoder layers moves first, then each layer at its turn, so the device never
    holds the 16-bit model (here on the CPU, what the layers' moves see: layer i moves, unquantized, only once the
    layers before it are quantized)."""
    import functools

    model = tiny_model("llama", num_hidden_layers=3)
    layers = model.model.layers
    seen = []

    def quantized(layer):
        return isinstance(layer.mlp.down_proj, QuantLinear)

    def spied_apply(i, *args, **kwargs):
        seen.append((i, quantized(layers[i]), [quantized(layer) for layer in layers[:i]]))
        return type(layers[i])._apply(layers[i], *args, **kwargs)
    for i, layer in enumerate(layers):
        monkeypatch.setattr(layer, "_apply", functools.partial(spied_apply, i))
    quantize_model(model, QuantConfig(group_size=32), progress=False, device="cpu")
    unquantized_moves = [(i, before) for i, was_quantized, before in seen if not was_quantized]
    assert unquantized_moves == [(0, []), (1, [True]), (2, [True, True])]


def test_calibration_is_refused_before_the_rotation_touches_the_model():
    """quantize_model checks the calibration before the rotation begins: GPTQ's own check (at its start) came after
    the embedding was rotated, the head untied and the model marked rotated, which a retry refused as rotated."""
    from nibble.models.rotation import rotation_seed

    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="calibration token ids run from 0 to 999"):
        quantize_model(model, QuantConfig(mode="w4a4", rotation="hadamard", method="gptq"), progress=False,
                       calibration=torch.arange(1000).reshape(10, 100))
    assert rotation_seed(model) is None and model.lm_head.weight is model.model.embed_tokens.weight
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_wrapped_causal_lm_is_refused_as_not_a_causal_lm():
    """A wrapper that forwards config and lm_head to the causal LM it holds as .model (as peft's PeftModel does)
    has no .model.layers: refused by name, not as an AttributeError from the decoder layers' lookup."""
    class Wrapper(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model, self.config, self.lm_head = model, model.config, model.lm_head

    model = Wrapper(tiny_model("llama"))
    with pytest.raises(ValueError, match="nibble converts causal LMs .*got Wrapper"):
        quantize_model(model, QuantConfig(group_size=32), progress=False)


def test_the_decoder_layers_are_put_back_whatever_the_body_raised():
    """decoder_layers_replaced stands a list in for the layers while the rest of the model moves (or calibrates):
    a move that failed (out of memory on the GPU) left the model without its decoder layers."""
    from nibble.models.architecture import decoder_layers, decoder_layers_replaced

    model = tiny_model()
    layers = decoder_layers(model)
    with pytest.raises(RuntimeError, match="out of memory"):
        with decoder_layers_replaced(model, nn.ModuleList()):
            assert len(decoder_layers(model)) == 0
            raise RuntimeError("out of memory")
    assert decoder_layers(model) is layers


def test_calibration_windows_of_the_whole_context_are_taken():
    """Windows of exactly config.max_position_embeddings tokens are within the model's context; one more is not."""
    from nibble.models.architecture import check_calibration_window

    check_calibration_window(256, 256)
    with pytest.raises(ValueError, match=r"seq_len=257 exceed the model's context \(256"):
        check_calibration_window(257, 256)
