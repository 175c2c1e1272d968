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
from nibble.nn.quant_linear import QuantLinear

CASES = {  # (architecture, config, dtype from_pretrained and load_quantized are given)
    "llama w4a16": ("llama", QuantConfig(group_size=32), None),
    "llama w4a16 bf16": ("llama", QuantConfig(group_size=32), torch.bfloat16),
    "qwen2 w4a16 hadamard, 16-bit down_proj": (
        "qwen2", QuantConfig(group_size=32, rotation="hadamard", modules_to_not_convert=("lm_head", "down_proj")),
        torch.bfloat16),
    "mistral w4a4 with lm_head": ("mistral", QuantConfig(mode="w4a4", modules_to_not_convert=()), None),
    "llama w4a4 hadamard": ("llama", QuantConfig(mode="w4a4", rotation="hadamard"), None),
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
    with pytest.raises(ValueError, match="purely quantized models"):
        validate_quantization_for_training(model)
    validate_quantization_for_training(peft.get_peft_model(model, lora_config(r=4, target_modules=["q_proj"])))
    assert model.half().model.embed_tokens.weight.dtype == torch.float16
    assert model.model.layers[0].self_attn.k_proj.scales.dtype == torch.float16  # (q_proj: peft wrapped it)
    assert model.float().model.embed_tokens.weight.dtype == torch.float32


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
