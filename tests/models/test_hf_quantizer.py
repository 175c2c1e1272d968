"""transformers' from_pretrained on nibble's own format (`nibble.models.hf_quantizer`): the model load_quantized
builds, with load_quantized's refusals."""
import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

import nibble
from conftest import tiny_model
from nibble import QuantConfig, load_quantized, quantize_model, save_quantized
from nibble.models.checkpoint_files import CheckpointError
from nibble.models.hf_quantizer import NibbleHfQuantizer, NibbleQuantizationConfig
from nibble.nn.hadamard import HadamardInputLinear
from nibble.kernels.hadamard import hadamard_transform
from nibble.nn.quant_linear import PermutedInputQuantLinear, QuantLinear

CASES = {  # (architecture, config, dtype from_pretrained and load_quantized are given)
    "llama w4a16": ("llama", QuantConfig(group_size=32), None),
    "llama w4a16 bf16": ("llama", QuantConfig(group_size=32), torch.bfloat16),
    "qwen2 w4a16 hadamard, 16-bit down_proj": (
        "qwen2", QuantConfig(group_size=32, rotation="hadamard", modules_to_not_convert=("lm_head", "down_proj")),
        torch.bfloat16),
    "mistral w4a4 with lm_head": ("mistral", QuantConfig(mode="w4a4", modules_to_not_convert=()), None),
    "llama w4a4 hadamard": ("llama", QuantConfig(mode="w4a4", rotation="hadamard"), None),
    "qwen3 w4a4 hadamard bf16": ("qwen3", QuantConfig(mode="w4a4", rotation="hadamard"), torch.bfloat16),
}


def _quantized(directory, arch="llama", config=QuantConfig(group_size=32)):
    model = tiny_model(arch)
    quantize_model(model, config, progress=False)
    save_quantized(model, directory)
    return model


def assert_same_model(got, want, ids):
    """``got`` (from_pretrained's) is ``want`` (load_quantized's): its modules' types, its tensors (names, dtypes,
    values), its tied head, its quantization_config and its logits, bit for bit."""
    assert [(n, type(m)) for n, m in got.named_modules()] == [(n, type(m)) for n, m in want.named_modules()]
    mine, theirs = got.state_dict(), want.state_dict()
    assert list(mine) == list(theirs)
    for name, t in theirs.items():
        assert mine[name].dtype == t.dtype and torch.equal(mine[name], t), name
    def tied(model):
        return getattr(model.lm_head, "weight", None) is model.model.embed_tokens.weight
    assert tied(got) == tied(want)
    assert got.config.quantization_config == want.config.quantization_config
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


@pytest.mark.parametrize("case", CASES)
def test_from_pretrained_builds_the_model_load_quantized_builds(tmp_path, case, caplog):
    arch, config, dtype = CASES[case]
    _quantized(tmp_path, arch, config)
    with caplog.at_level(logging.WARNING):  # no dtype: config.json's (dtype=None reads the first float tensor's)
        got = AutoModelForCausalLM.from_pretrained(tmp_path, **({"dtype": dtype} if dtype else {}))
    # transformers skipped the unknown method with a warning, then named every QuantLinear buffer as unexpected
    assert not [r for r in caplog.records if r.name.startswith("transformers")], caplog.text
    want, _ = load_quantized(tmp_path, dtype=dtype)
    assert any(isinstance(m, QuantLinear) for m in got.modules())
    assert any(isinstance(m, HadamardInputLinear) for m in got.modules()) == ("16-bit down_proj" in case)
    assert got.model.embed_tokens.weight.dtype == (dtype or torch.float32) and not got.training
    assert_same_model(got, want, torch.randint(0, 256, (2, 9)))
    with pytest.raises(ValueError, match="nibble.save_quantized"):  # its checkpoint would load as random linears
        got.save_pretrained(tmp_path / "again")
    save_quantized(got, tmp_path / "resaved")  # nibble's save takes it as load_quantized's
    assert_same_model(load_quantized(tmp_path / "resaved", dtype=dtype)[0], want, torch.randint(0, 256, (2, 9)))


def test_a_flipped_byte_is_refused(tmp_path):
    _quantized(tmp_path)
    f = tmp_path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x55
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_an_edited_config_json_is_refused_naming_the_field(tmp_path):
    _quantized(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"another config .*rms_norm_eps 1e-0?6 when saved, 0.001 now"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("override,said", [({"num_hidden_layers": 1}, "num_hidden_layers 2 when saved, 1 now"),
                                           ({"rms_norm_eps": 0.5}, "rms_norm_eps 1e-0?6 when saved, 0.5 now")])
def test_config_arguments_that_change_the_architecture_are_refused(tmp_path, override, said):
    """A layer fewer failed as "ModuleList has no attribute `1`"; another epsilon ran weights quantized for the
    saved one. Arguments that leave the weights' function alone load."""
    _quantized(tmp_path)
    with pytest.raises(ValueError, match=rf"from_pretrained's arguments change the config .* \({said}\): load it "
                                         "without them"):
        AutoModelForCausalLM.from_pretrained(tmp_path, **override)
    AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", device_map="cpu")


def test_a_value_the_asked_dtype_cannot_hold_is_refused(tmp_path):
    model = tiny_model("llama", dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.embed_tokens.weight.view(-1)[3] = 1e6
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    save_quantized(model, tmp_path)
    with pytest.raises(ValueError, match=r"embed_tokens\.weight holds 1 value\(s\) beyond torch\.float16's range"):
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float16)


def test_a_float_model_is_not_quantized_by_from_pretrained(tmp_path):
    """nibble's quantizer only loads: quantize_model quantizes (transformers refuses a method that needs
    calibration)."""
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does require the model to be pre-quantized"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=NibbleQuantizationConfig(mode="w4a16"))


@pytest.mark.parametrize("loader", ["quantize_model", "load_quantized", "from_pretrained"])
def test_the_trainer_takes_lora_adapters_on_it_and_refuses_it_bare(tmp_path, loader):
    """transformers' Trainer checks a quantized model through its quantizer: bare, there is nothing it can train (INT4
    buffers), and it trained the embeddings and norms of a model nibble quantized without a word; with peft's LoRA on
    nibble's layers it trains the adapters. ``.half()``, which transformers refuses for a quantized model, casts as
    ``.to(torch.float16)`` does."""
    peft = pytest.importorskip("peft")
    from transformers.trainer_utils import validate_quantization_for_training

    from nibble.nn.lora import lora_config

    model = _quantized(tmp_path)
    if loader != "quantize_model":
        model = load_quantized(tmp_path)[0] if loader == "load_quantized" else \
            AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.is_quantized and model.hf_quantizer.is_trainable and model.hf_quantizer.is_compileable
    # the rest of what from_pretrained leaves, whichever loader made the model: the method's name, its settings
    assert model.quantization_method == "nibble" and model.hf_quantizer.quantization_config.group_size == 32
    with pytest.raises(ValueError, match="purely quantized models"):
        validate_quantization_for_training(model)
    validate_quantization_for_training(peft.get_peft_model(model, lora_config(r=4, target_modules=["q_proj"])))
    assert model.half().model.embed_tokens.weight.dtype == torch.float16
    assert model.model.layers[0].self_attn.k_proj.scales.dtype == torch.float16  # (q_proj: peft wrapped it)
    assert model.float().model.embed_tokens.weight.dtype == torch.float32


def _functions(model):
    """{name: (W, bias)} of every layer a dequantization replaces, W as the layer computes x @ W.T without activation
    rounding: probed with the identity through the layer's own paths (a QuantLinear's forward-mode product gathers its
    act-order input and rotates it as its forward does), in float32."""
    out = {}
    for name, layer in model.named_modules():
        if isinstance(layer, (QuantLinear, HadamardInputLinear)):
            if isinstance(layer, QuantLinear):
                w = layer._output_tangent(torch.eye(layer.in_features, device=layer.qweight.device))
            else:
                eye = torch.eye(layer.in_features, device=layer.weight.device)
                w = torch.nn.functional.linear(hadamard_transform(eye), layer.weight.float())
            out[name] = (w.t(), None if layer.bias is None else layer.bias.detach().clone())
    return out


def _check_dequantized(model, want, dtype):
    for name, (w, bias) in want.items():
        layer = model.get_submodule(name)
        assert type(layer) is torch.nn.Linear and layer.weight.dtype == dtype, name
        assert (layer.out_features, layer.in_features) == tuple(w.shape), name  # what peft reads of the layer
        # float64 to dtype once against the probe's float32 rounded again: one unit of the last place apart at most,
        # or float32's rounding where a Hadamard's sum cancels to ~0
        torch.testing.assert_close(layer.weight, w.to(dtype), rtol=0 if dtype == torch.float32 else 2 ** -7,
                                   atol=1e-6, msg=name)
        assert (layer.bias is None) == (bias is None) and (bias is None or torch.equal(layer.bias, bias.to(dtype)))
    assert not any(isinstance(m, (QuantLinear, HadamardInputLinear)) for m in model.modules())
    assert not model.is_quantized and not hasattr(model, "hf_quantizer")
    assert not hasattr(model.config, "quantization_config") and not hasattr(model, "quantization_method")


@pytest.mark.parametrize("case", [*CASES, "llama w4a16 tied lm_head"])
def test_dequantize_gives_the_float_model_any_loader_reads(tmp_path, case):
    """``model.dequantize()``: every nibble layer becomes the nn.Linear of its function without activation rounding
    (online Hadamards folded, the tied lm_head its own table), in the dtype the model runs in; save_pretrained then
    writes a plain checkpoint, which from_pretrained reads as that model. W4A16 keeps its logits."""
    arch, config, dtype = CASES.get(case, ("llama", QuantConfig(group_size=32, modules_to_not_convert=()), None))
    _quantized(tmp_path / "q", arch, config)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "q", **({"dtype": dtype} if dtype else {}))
    ids, want = torch.randint(0, 256, (2, 9)), _functions(model)
    with torch.no_grad():
        quantized = model(ids).logits
    assert model.dequantize() is model
    _check_dequantized(model, want, dtype or torch.float32)
    with torch.no_grad():
        logits = model(ids).logits
    if config.mode == "w4a16":
        torch.testing.assert_close(logits, quantized, rtol=0, atol=1e-5 if dtype is None else 0.05)
    model.save_pretrained(tmp_path / "float")
    assert "quantization_config" not in json.loads((tmp_path / "float" / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "float", **({"dtype": dtype} if dtype else {}))
    assert [type(m) for m in plain.modules()] == [type(m) for m in model.modules()]
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, logits)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_dequantize_undoes_act_order_input_orders(mode):
    """A PermutedInputQuantLinear computes x[..., perm] @ W.T (after its online Hadamard in W4A4): the float weight
    holds column k of W at perm[k]."""
    config = QuantConfig(group_size=32) if mode == "w4a16" else QuantConfig(mode="w4a4", rotation="hadamard")
    model = quantize_model(tiny_model(), config, progress=False)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        old = model.get_submodule(name)
        layer = PermutedInputQuantLinear.from_weight(old.weight_int4(), old.bias, mode, old.input_hadamard,
                                                     dtype=torch.float32)
        layer.set_input_perm(torch.randperm(old.in_features))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    ids, want = torch.randint(0, 256, (2, 9)), _functions(model)
    with torch.no_grad():
        quantized = model(ids).logits
    model.dequantize()
    _check_dequantized(model, want, torch.float32)
    if mode == "w4a16":
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, quantized, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_dequantize_to_another_dtype_casts_the_whole_model(tmp_path, arch):
    """mistral: its untied lm_head, left 16-bit, is cast too (a cast of the decoder alone left it in bfloat16)."""
    _quantized(tmp_path, arch)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    want = _functions(model)
    model.dequantize(torch.float32)
    _check_dequantized(model, want, torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.isfinite(model(torch.randint(0, 256, (2, 9))).logits).all()


def test_dequantize_runs_in_the_dtype_the_model_was_cast_to():
    """A model cast after quantization (``.to(torch.bfloat16)``) dequantizes in the dtype it runs in, not in the
    dtype its config still records (transformers' default, float32 here), which cast the whole model back."""
    model = quantize_model(tiny_model("qwen2"), QuantConfig(group_size=32), progress=False).to(torch.bfloat16)
    assert model.config.dtype == torch.float32
    want = _functions(model)
    model.dequantize()
    _check_dequantized(model, want, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_dequantized_model_takes_what_a_float_model_takes():
    """What quantization and rotation put on the model goes with its quantized layers: a cast to float64 (refused
    for a quantized model), resize_token_embeddings of the lm_head that was quantized, and another rotation
    (refused for a model recorded as rotated), as on the float model save_pretrained writes and from_pretrained
    reads. They stayed refused when dequantize left those overrides and records on the model."""
    from nibble.models.rotation import check_rotatable, rotation_seed, rotation_untied_head

    config = QuantConfig(mode="w4a4", rotation="hadamard", modules_to_not_convert=())
    model = quantize_model(tiny_model("llama"), config, progress=False)
    assert isinstance(model.lm_head, QuantLinear) and rotation_seed(model) == 0 and rotation_untied_head(model)
    model.dequantize()
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        logits = model(ids).logits
        double = model.to(torch.float64)(ids).logits
    assert double.dtype == torch.float64 and model.model.embed_tokens.weight.dtype == torch.float64
    torch.testing.assert_close(double, logits.double(), rtol=0, atol=1e-5)
    assert rotation_seed(model) is None and not rotation_untied_head(model)
    check_rotatable(model)  # a float model in a rotated basis rotates again as any float model
    model.resize_token_embeddings(264)
    assert model.lm_head.weight.shape == (264, 64) and model.model.embed_tokens.weight.shape == (264, 64)


def test_dequantize_refuses_what_it_cannot_make_leaving_the_model_quantized(tmp_path):
    """An integer dtype, and LoRA adapters around nibble's layers (peft's layer would keep its INT4 frame around a
    float base), an act-order layer's (a QuantLinear subclass) too."""
    peft = pytest.importorskip("peft")
    from nibble.nn.lora import lora_config

    model = _quantized(tmp_path)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        model.dequantize(torch.int8)
    lora = peft.get_peft_model(model, lora_config(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"LoRA adapters wrap 2 quantized linears \(model\.layers\.0\.self_attn\.q_proj, \.\.\.\): "
                                         "dequantize the model before adding adapters, or unload them first"):
        lora.dequantize()
    assert model.is_quantized and isinstance(model.model.layers[0].self_attn.k_proj, QuantLinear)
    model = quantize_model(tiny_model(), QuantConfig(group_size=32), progress=False)
    old = model.model.layers[0].mlp.down_proj
    model.model.layers[0].mlp.down_proj = PermutedInputQuantLinear.from_weight(old.weight_int4(), old.bias,
                                                                                dtype=torch.float32)
    model.model.layers[0].mlp.down_proj.set_input_perm(torch.randperm(old.in_features))
    lora = peft.get_peft_model(model, lora_config(r=4, target_modules=["model.layers.0.mlp.down_proj"]))
    with pytest.raises(ValueError, match=r"wrap 1 quantized linears \(model\.layers\.0\.mlp\.down_proj, \.\.\.\)"):
        lora.dequantize()
    assert isinstance(model.model.layers[0].mlp.down_proj.base_layer, PermutedInputQuantLinear)


def test_registration_is_once_and_public():
    assert AUTO_QUANTIZER_MAPPING["nibble"] is NibbleHfQuantizer
    nibble.register_hf_quantizer()  # again: no "already registered" error
    assert AUTO_QUANTIZER_MAPPING["nibble"] is NibbleHfQuantizer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["llama w4a16 bf16", "llama w4a4 hadamard"])
def test_gpu_from_pretrained_runs_the_kernels_as_load_quantized(tmp_path, case):
    arch, config, _ = CASES[case]
    _quantized(tmp_path, arch, config)
    got = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cuda")
    want, _ = load_quantized(tmp_path, device="cuda", dtype=torch.bfloat16)
    assert got.model.layers[0].self_attn.q_proj.qweight.is_cuda
    ids = torch.randint(0, 256, (2, 9), device="cuda")
    assert_same_model(got, want, ids)
    assert torch.equal(got.generate(ids, max_new_tokens=4, do_sample=False),
                       want.generate(ids, max_new_tokens=4, do_sample=False))
    from torch._dynamo.utils import counters

    counters.clear()  # the quantizer says the layers compile: generate's static-cache decode compiles them
    static = got.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static")
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    assert static.shape == (2, 13)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_dequantize_makes_the_float_model_on_the_gpu(tmp_path):
    _quantized(tmp_path, "llama", CASES["llama w4a4 hadamard"][1])
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cuda")
    want = _functions(model)
    model.dequantize()
    _check_dequantized(model, want, torch.bfloat16)
    assert model.model.layers[0].mlp.down_proj.weight.is_cuda
    ids = torch.randint(0, 256, (2, 9), device="cuda")
    assert torch.isfinite(model(ids).logits).all()
