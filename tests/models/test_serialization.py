import json
import os
import re
import shutil

import pytest
import torch

from conftest import tiny_model, tiny_tokenizer as _tokenizer
from nibble import QuantConfig, load_quantized, quantize_model, save_quantized
from nibble.models import checkpoint_files
from nibble.models.checkpoint_files import CheckpointError, tensor_sha256


@pytest.fixture
def saved(tmp_path):
    model = tiny_model("qwen2")
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    save_quantized(model, tmp_path / "q")
    return model, tmp_path / "q"


@pytest.mark.parametrize("arch,mode", [("llama", "w4a16"), ("qwen2", "w4a16"), ("mistral", "w4a4")])
def test_save_load_roundtrip_gives_identical_logits(tmp_path, arch, mode):
    model = tiny_model(arch)
    quantize_model(model, QuantConfig(mode=mode, group_size=32 if mode == "w4a16" else None), progress=False)
    save_quantized(model, tmp_path)
    loaded, tok = load_quantized(tmp_path)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert tok is None
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "nibble" and qc["format_version"] == 2 and qc["bits"] == 4
    assert qc["mode"] == mode and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_tied_embeddings_survive_the_roundtrip(saved, dtype):
    """In another dtype than saved (a model quantized on the CPU, loaded on a GPU) lm_head got its own copy of the
    embedding, which an edit of the embedding no longer reached and a re-save stored twice."""
    _, path = saved
    loaded, _ = load_quantized(path, dtype=dtype)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_the_dtype_the_model_holds_is_recorded(tmp_path):
    """config.dtype stayed what the model was built in: a model saved after .to(float16) loaded back in bfloat16."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    model.to(torch.float16)
    save_quantized(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float16"
    loaded, _ = load_quantized(tmp_path)
    ids = torch.randint(0, 256, (2, 9))
    assert loaded.model.embed_tokens.weight.dtype == torch.float16
    with torch.no_grad():  # (.to() also cast the rotary inv_freq, which a load rebuilds in float32)
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=2e-3)


def test_truncated_file_is_a_clear_error(saved):
    _, path = saved
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as e:
        load_quantized(path)
    assert isinstance(e.value, ValueError)  # one `except ValueError` catches every bad file nibble reads


def test_edited_bytes_fail_the_checksum(saved):
    _, path = saved
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x55  # flip bits inside the last tensor's data
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_quantized(path)


def _edit_header(path, key, old, new):
    """The checkpoint's safetensors header with ``key``'s entry ``old`` replaced by ``new`` (of the same length)."""
    f = path / "model.safetensors"
    data = f.read_bytes()
    size = int.from_bytes(data[:8], "little")
    start = data.index(json.dumps(key).encode(), 8, 8 + size)
    at = data.index(old, start, 8 + size)
    f.write_bytes(data[:at] + new + data[at + len(old):])


@pytest.mark.parametrize("key,old,new", [("model.layers.0.self_attn.q_proj.scales", b'"F16"', b'"I16"'),
                                         ("model.layers.0.self_attn.q_proj.qweight", b'"I32"', b'"F32"'),
                                         ("model.norm.weight", b'"F32"', b'"I32"')])
def test_a_tensors_dtype_edited_in_the_header_fails_the_checksum(saved, key, old, new):
    """The checksums covered the data alone: the same bytes read under another dtype of the same width (one edited
    header byte) loaded as another model (int16 scales: every logit off), or failed at the first forward."""
    _, path = saved
    _edit_header(path, key, old, new)
    with pytest.raises(CheckpointError, match=f"checksum mismatch in 1 tensor.*{key}"):
        load_quantized(path)


def test_a_tensor_reshaped_in_the_file_fails_the_checksum(saved):
    """The same bytes under another shape of as many elements (a converter's reshape, an edited header): the
    checksums cover the shape (CHECKSUM_VERSION 2), so the tensor is named, not loaded or blamed on the model."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    _, path = saved
    key = "model.layers.0.self_attn.q_proj.qweight"
    with safe_open(path / "model.safetensors", "pt") as f:
        metadata = f.metadata()
    tensors = load_file(path / "model.safetensors")
    rows, cols = tensors[key].shape
    tensors[key] = tensors[key].reshape(rows * 2, cols // 2)
    save_file(tensors, path / "model.safetensors", metadata=metadata)
    with pytest.raises(CheckpointError, match=f"checksum mismatch in 1 tensor.*{key}"):
        load_quantized(path)


@pytest.mark.parametrize("part,old,new,held,want", [("scales", b'"F16"', b'"I16"', "int16", "float16"),
                                                    ("zeros", b'"F16"', b'"BF16"', "bfloat16", "float16"),
                                                    ("qweight", b'"I32"', b'"F32"', "float32", "int32")])
def test_a_quantized_tensor_in_another_dtype_than_the_formats_is_refused(saved, part, old, new, held, want):
    """A checkpoint whose checksums cover the data alone (before session 58), or a converter's, edited the same way:
    each of the format's three tensors (bfloat16 zeros, as wide as float16, read as another number each)."""
    from safetensors.torch import load_file, save_file

    _, path = saved
    if len(new) > len(old):  # the header's entry one byte longer: the file rewritten from its tensors instead
        tensors = load_file(path / "model.safetensors")
        key = f"model.layers.0.self_attn.q_proj.{part}"
        tensors[key] = tensors[key].view(torch.bfloat16)
    else:
        _edit_header(path, f"model.layers.0.self_attn.q_proj.{part}", old, new)
        tensors = load_file(path / "model.safetensors")
    save_file(tensors, path / "model.safetensors", metadata={"nibble": json.dumps(
        {"checksums": {k: tensor_sha256(v, typed=False) for k, v in tensors.items()}, "aliases": {}})})
    with pytest.raises(CheckpointError, match=rf"q_proj\.{part} is torch\.{held}, where nibble's format holds "
                                              rf"torch\.{want}: the file was edited"):
        load_quantized(path)


def _rewrite_tensors(path, edit, checksums=True, config_digest=True):
    """Rewrite the checkpoint ``path``'s weights as ``edit`` changes their dict, their checksum table made anew (as a
    tool that edits them and writes nibble's metadata would) or, not ``checksums``, left as saved; without
    ``config_digest``, the saved config's digest left out (a converter's file, which has none)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    with safe_open(path / "model.safetensors", "pt") as f:
        ours = json.loads(f.metadata()["nibble"])
    if not config_digest:
        del ours["config"]
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    if checksums:
        ours["checksums"] = {k: tensor_sha256(v) for k, v in tensors.items()}
    save_file(tensors, path / "model.safetensors", metadata={"nibble": json.dumps(ours)})


def _refused_by_both(path, said: str, tensor: str) -> None:
    """load_quantized and `nibble info`'s quantized_structure both refuse the edited checkpoint ``path``, naming
    ``tensor``."""
    from nibble.models.serialization import quantized_structure
    for load in (load_quantized, quantized_structure):
        with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path / 'model.safetensors'))} {re.escape(said)}, e\.g\. "
                                                  rf"\['{re.escape(tensor)}'\]: the file was edited"):
            load(path)


@pytest.mark.parametrize("tensor,shape,checksums", [
    ("model.layers.0.mlp.down_proj.bias", (64,), False),  # a quantized linear's: its bias is the file's (below)
    ("lm_head.bias", (256,), True), ("lm_head.bias", (256,), False),
    ("model.layers.1.mlp.gate", (3, 5), True), ("model.layers.1.mlp.gate", (3, 5), False)])
def test_a_tensor_the_model_does_not_have_is_refused_naming_it(saved, tensor, shape, checksums):
    """`nibble info` showed a quantized linear's bias the checksum table did not list. Other tensors were refused in
    torch's words, or as "tensor names do not match the checksum table" naming none."""
    _, path = saved
    _rewrite_tensors(path, lambda tensors: tensors.update({tensor: torch.randn(shape)}), checksums)
    said = ("holds 1 tensor(s) the model of its config.json does not have" if checksums
            else "holds 1 tensor(s) its checksum table does not list")
    _refused_by_both(path, said, tensor)


def test_a_bias_the_architecture_lacks_round_trips(tmp_path):
    """A quantized linear's bias is the checkpoint's, not only its architecture's (an AutoGPTQ import before 0.5 has
    one on every linear, as has a model given one before quantizing): a model that saves must load, and answer alike."""
    model = tiny_model("llama")
    down = model.model.layers[0].mlp.down_proj
    down.bias = torch.nn.Parameter(torch.randn(down.out_features))
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    save_quantized(model, tmp_path)
    loaded, _ = load_quantized(tmp_path)
    assert torch.equal(loaded.model.layers[0].mlp.down_proj.bias, model.model.layers[0].mlp.down_proj.bias)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.parametrize("checksums", [True, False])
@pytest.mark.parametrize("tensor", ["model.layers.1.self_attn.k_proj.bias", "model.norm.weight"])
def test_a_tensor_of_the_model_the_checkpoint_lacks_is_refused_naming_it(saved, tensor, checksums):
    """A Qwen2 checkpoint without one of its q/k/v biases (the checksums made anew) loaded that layer without a bias,
    and `nibble info` showed it so whatever the checksums said."""
    _, path = saved
    _rewrite_tensors(path, lambda tensors: tensors.pop(tensor), checksums)
    said = ("lacks 1 of the tensors of the model of its config.json" if checksums
            else "lacks 1 tensor(s) its checksum table lists")
    _refused_by_both(path, said, tensor)


def test_newer_format_version_is_refused(saved):
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["format_version"] = 99
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="format_version 99 is not supported"):
        load_quantized(path)


def test_missing_files_and_non_quantized_dirs_are_clear_errors(tmp_path, saved):
    with pytest.raises(FileNotFoundError, match="nowhere' is not a local checkpoint directory. nibble never downloads"):
        load_quantized(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json is missing: not a nibble, AutoAWQ or GPTQ checkpoint"):
        load_quantized(tmp_path / "empty")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")  # nibble info FILE.gguf: a float model, to quantize first
    with pytest.raises(CheckpointError, match=r"model\.gguf is a file \(a GGUF file, a float model: quantize it first, "
                                              r"with `nibble quantize --model FILE --out DIR`.*\): a checkpoint is"):
        load_quantized(tmp_path / "model.gguf")
    model = tiny_model()
    model.save_pretrained(tmp_path / "plain")
    with pytest.raises(CheckpointError, match=r"no quantization_config: not a quantized model \(a float model loads "
                                              r"with nibble\.models\.loading\.load_model, and nibble\.quantize_model"):
        load_quantized(tmp_path / "plain")
    with pytest.raises(ValueError, match="run nibble.quantize_model first"):
        save_quantized(model, tmp_path / "x")


def test_a_quantized_lm_head_roundtrips_untied(tmp_path):
    model = tiny_model("llama")  # tied: quantizing lm_head unties it
    quantize_model(model, QuantConfig(group_size=32, modules_to_not_convert=[]), progress=False)
    save_quantized(model, tmp_path)
    loaded, _ = load_quantized(tmp_path)
    assert type(loaded.lm_head).__name__ == "QuantLinear" and loaded.config.tie_word_embeddings is False
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_bad_devices_are_refused_by_name(saved, monkeypatch):
    _, path = saved
    # "gpu" used to pass torch.device's check late and surface as "weights do not match the saved architecture".
    with pytest.raises(ValueError, match="device 'gpu' is not a device torch knows"):
        load_quantized(path, device="gpu")
    # "meta" failed as "buffers the checkpoint does not hold", "mps" as "weights do not match the saved architecture"
    for other in ("meta", "mps"):
        with pytest.raises(ValueError, match=f"device '{other}' is not one nibble runs on: use 'cpu', 'cuda'"):
            load_quantized(path, device=other)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # not "Torch not compiled with CUDA enabled"
    for cuda in ("cuda", 0):  # 0: torch's spelling of cuda:0, which was "not a device torch knows"
        with pytest.raises(ValueError, match="device 'cuda(:0)?' asked for, but no CUDA GPU is visible"):
            load_quantized(path, device=cuda)


@pytest.mark.parametrize("saved_as,device,expected", [
    ("float32", "cpu", torch.float32), ("float32", "cuda", torch.bfloat16),  # quantized on the CPU, run on a GPU
    (None, "cpu", torch.float32), (None, "cuda", torch.bfloat16),           # a GGUF model records no dtype
    ("bfloat16", "cpu", torch.bfloat16), ("float16", "cuda", torch.float16), ("bogus", "cuda", torch.bfloat16),
    ("int8", "cpu", torch.float32)])  # no model runs in it: from_config refused it, naming no file
def test_the_default_dtype_is_the_saved_one_but_float32_on_a_gpu(saved_as, device, expected):
    from nibble.models.serialization import _saved_dtype
    assert _saved_dtype({"dtype": saved_as}, torch.device(device)) == expected


def test_a_model_saved_in_float32_loads_in_its_dtype_on_the_cpu(saved):
    model, path = saved
    assert json.loads((path / "config.json").read_text())["dtype"] == "float32"
    loaded, _ = load_quantized(path)
    assert loaded.model.embed_tokens.weight.dtype == torch.float32
    loaded, _ = load_quantized(path, dtype=torch.bfloat16)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_model_quantized_on_the_cpu_runs_in_bf16_on_the_gpu(saved):
    model, path = saved
    loaded, _ = load_quantized(path, device="cuda")
    assert {p.dtype for p in loaded.parameters() if p.is_floating_point()} == {torch.bfloat16}
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
        out = loaded(ids.cuda()).logits.float().cpu()
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - ref).abs().max() <= 0.05 * ref.abs().max()


def test_dtypes_are_taken_by_name_and_others_refused_before_loading(saved):
    _, path = saved
    loaded, _ = load_quantized(path, dtype="bfloat16")  # as transformers' from_pretrained takes it
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    for bad in ("float8", torch.int8, "int32", 3):
        with pytest.raises(ValueError, match=f"dtype {bad!r} is not one nibble runs a model in"):
            load_quantized(path, dtype=bad)


def test_a_rotated_16_bit_down_proj_keeps_its_online_hadamard_through_the_roundtrip(tmp_path):
    """W4A4 + Hadamard with down_proj kept in 16 bits: the rotation left it a float HadamardInputLinear (its weight
    W @ H.T, for a rotated input), which the checkpoint did not record, so it loaded as a plain nn.Linear: SmolLM2's
    perplexity went from 83 to 3.7e9, without a word."""
    from nibble.nn.hadamard import HadamardInputLinear
    model = tiny_model("llama")
    quantize_model(model, QuantConfig(mode="w4a4", rotation="hadamard", modules_to_not_convert=["lm_head", "down_proj"]),
                   progress=False)
    assert isinstance(model.model.layers[0].mlp.down_proj, HadamardInputLinear)
    save_quantized(model, tmp_path)
    loaded, _ = load_quantized(tmp_path)
    assert isinstance(loaded.model.layers[0].mlp.down_proj, HadamardInputLinear)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.parametrize("online_o_proj", [False, True])
def test_a_model_rotated_before_quantize_model_saves_its_rotation_and_loads_back_the_same_logits(tmp_path,
                                                                                                online_o_proj):
    """rotate_model then quantize_model(w4a4) recorded rotation 'none' (and seed 0) in the checkpoint: the seed was
    rotate_model's alone. The online Hadamards came back (the modules say where they are), the config lied. So did
    a quantized head's tie, which rotate_model removed (lm_head_was_tied: the bytes saved)."""
    from nibble.models.convert import weight_bytes
    from nibble.models.rotation import rotate_model
    model = rotate_model(tiny_model("llama"), seed=5, online_o_proj=online_o_proj)
    quantize_model(model, QuantConfig(mode="w4a4", modules_to_not_convert=[]), progress=False)
    save_quantized(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert (saved["rotation"], saved["rotation_seed"], saved["lm_head_was_tied"]) == ("hadamard", 5, True)
    linears = ["self_attn.o_proj", "mlp.down_proj"] if online_o_proj else ["mlp.down_proj"]
    assert saved["online_hadamard_modules"] == [f"model.layers.{i}.{n}" for i in range(2) for n in linears]
    loaded, _ = load_quantized(tmp_path)
    assert (loaded.config.quantization_config["rotation"], loaded.config.quantization_config["rotation_seed"]) == (
        "hadamard", 5)
    assert loaded.model.layers[1].self_attn.o_proj.input_hadamard == online_o_proj
    assert weight_bytes(loaded) == weight_bytes(model)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.parametrize("fmt", ["nibble", "awq", "gptq"])
def test_generation_config_survives_the_roundtrip(tmp_path, fmt):
    """An Instruct model's end-of-turn token and sampling defaults live in generation_config.json only (Llama-3's
    <|eot_id|>): a checkpoint without it decoded past the end of the turn, and an imported AutoAWQ / GPTQ one lost
    the file it ships."""
    from transformers import GenerationConfig
    model = tiny_model("llama")
    model.config.eos_token_id = 2
    model.generation_config = GenerationConfig(eos_token_id=[2, 7], do_sample=True, temperature=0.6, top_p=0.9)
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    save_quantized(model, tmp_path, format=fmt)
    loaded, _ = load_quantized(tmp_path)
    g = loaded.generation_config
    assert (g.eos_token_id, g.do_sample, g.temperature, g.top_p) == ([2, 7], True, 0.6, 0.9)


def test_save_pretrained_is_refused_with_the_way_to_save(saved, tmp_path):
    """transformers' save_pretrained wrote the INT4 buffers without what nibble's loader needs, and from_pretrained
    read that directory (or a save_quantized one) as random linears after a warning."""
    import copy
    import pickle
    model, path = saved
    loaded, _ = load_quantized(path)
    for m in (model, loaded, copy.deepcopy(loaded), pickle.loads(pickle.dumps(loaded))):
        with pytest.raises(ValueError, match=r"nibble\.save_quantized\(model, directory, tokenizer\)"):
            m.save_pretrained(tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_weights_under_another_quantization_config_are_refused(tmp_path):
    """A re-save into a directory interrupted between its two files left the new (rotated) weights beside the old
    config.json: it loaded without a word and ran as another model (SmolLM2 perplexity 112 -> 1e9)."""
    import shutil
    for name, rotation in (("old", "none"), ("new", "hadamard")):
        model = tiny_model("llama")
        quantize_model(model, QuantConfig(mode="w4a4", rotation=rotation), progress=False)
        save_quantized(model, tmp_path / name)
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    config["eos_token_id"], config["_name_or_path"] = 7, "elsewhere"  # keys that do not change what the weights mean
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    load_quantized(tmp_path / "old")
    shutil.copy(tmp_path / "new" / "model.safetensors", tmp_path / "old" / "model.safetensors")
    with pytest.raises(CheckpointError, match="saved with another config than .*config.json holds "
                                              r'\(quantization_config.online_hadamard_modules \["model.layers.0.mlp.'
                                              r'down_proj", "model.layers.1.mlp.down\.\.\. when saved, \[\] now; '
                                              r'quantization_config.rotation "hadamard" when saved, "none" now'):
        load_quantized(tmp_path / "old")


def test_a_refusal_names_at_most_five_changed_fields_and_counts_the_rest():
    """Each changed field is named with both values, in name order, nested ones dotted; past five, counted."""
    from nibble.models.checkpoint_files import config_changes, digested_config
    config = tiny_model("llama").config.to_dict()
    config["quantization_config"] = {"mode": "w4a16", "group_size": 32}
    saved = json.loads(json.dumps(digested_config(config), default=str))
    edited = {**config, "quantization_config": {"mode": "w4a16", "group_size": 64}, "rms_norm_eps": 0.5}
    assert config_changes(saved, edited) == ("quantization_config.group_size 32 when saved, 64 now; "
                                             f"rms_norm_eps {json.dumps(config['rms_norm_eps'])} when saved, 0.5 now")
    many = {**edited, **{f"extra_{i}": i for i in range(5)}}
    said = config_changes(saved, many)
    assert said.startswith("extra_0 absent when saved, 0 now; ") and said.endswith(" (and 2 more)")
    assert said.count(" when saved, ") == 5


@pytest.mark.parametrize("fmt", ["nibble", "gptq"])
def test_a_config_that_transformers_rewrote_or_harmless_fields_edited_still_loads(tmp_path, fmt):
    """The digest covered config.json as written: transformers' own round trip (which drops fields at their defaults)
    or an edit of architectures / id2label / output flags / the attention backend refused the checkpoint."""
    from transformers import AutoConfig
    model = tiny_model("llama")
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    save_quantized(model, tmp_path / "q", format=fmt)
    AutoConfig.from_pretrained(tmp_path / "q").save_pretrained(tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config.update(architectures=["Other"], id2label={"0": "a"}, output_hidden_states=True, attn_implementation="eager",
                  initializer_range=0.5)
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    load_quantized(tmp_path / "q")
    config["rms_norm_eps"] = 1e-3
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    # the refusal names the field (it said only "another config", leaving the user to diff the file by hand)
    with pytest.raises(CheckpointError, match=r"another config than .*config.json holds \(rms_norm_eps 1e-0?6 when "
                                              r"saved, 0.001 now\): an edited config.json \(undo the edit\)"):
        load_quantized(tmp_path / "q")


def test_a_checkpoint_of_this_format_says_so_to_an_older_nibble(saved):
    """Checksums over dtype and shape made today's checkpoints "corrupt" to a nibble of format version 1; the version
    is 2 now, which that nibble refuses as a format it does not read. Version 1 checkpoints load."""
    _, path = saved
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["format_version"] == 2
    assert QuantConfig.from_dict({**config["quantization_config"], "format_version": 1}) == \
        QuantConfig.from_dict(config["quantization_config"])


@pytest.mark.parametrize("key,value", [("rope_theta", 5e5), ("rms_norm_eps", 1e-3), ("hidden_act", "gelu")])
def test_weights_under_another_architecture_config_are_refused(tmp_path, key, value):
    """The digest covered the quantization_config alone: weights saved beside another model's config.json of the same
    shapes and QuantConfig (another RoPE theta, norm epsilon or activation) loaded without a word as another model."""
    import shutil
    for name, overrides in (("old", {}), ("new", {key: value})):
        model = tiny_model("llama", **overrides)
        quantize_model(model, QuantConfig(group_size=32), progress=False)
        save_quantized(model, tmp_path / name)
    shutil.copy(tmp_path / "new" / "model.safetensors", tmp_path / "old" / "model.safetensors")
    # the weights' value and config.json's are named (transformers 5 keeps rope_theta in rope_parameters)
    with pytest.raises(CheckpointError, match=rf"config.json holds \((\w+\.)?{key} {re.escape(json.dumps(value))} "
                                              r"when saved, \S+ now\)"):
        load_quantized(tmp_path / "old")


def test_checkpoints_whose_digest_covers_the_quantization_config_alone_still_load(saved):
    """Sessions 56-57 stored the digest of the quantization_config only: those checkpoints load, and weights beside
    another quantization_config are still refused."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from nibble.models.checkpoint_files import _digest
    model, path = saved
    config = json.loads((path / "config.json").read_text())
    with safe_open(path / "model.safetensors", "pt") as f:
        aliases = json.loads(f.metadata()["nibble"])["aliases"]
    tensors = load_file(path / "model.safetensors")
    ours = {"checksums": {k: tensor_sha256(v, typed=False) for k, v in tensors.items()}, "aliases": aliases,
            "quantization_config": _digest(config["quantization_config"])}
    save_file(tensors, path / "model.safetensors", metadata={"nibble": json.dumps(ours)})
    loaded, _ = load_quantized(path)
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    config["quantization_config"]["clip_search"] = not config["quantization_config"]["clip_search"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="saved with another config than"):
        load_quantized(path)


def _quantized(arch="llama"):
    model = tiny_model(arch)
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    return model


def _reshard(directory):
    """The folder's model.safetensors as two shards and an index, as transformers, AutoAWQ and GPTQModel write a
    large model."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(directory / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, directory / file, metadata={"format": "pt"})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "model.safetensors").unlink()


@pytest.mark.parametrize("fmt", ["nibble", "awq", "gptq"])
def test_a_save_into_a_sharded_checkpoints_folder_leaves_none_of_its_shards(tmp_path, fmt):
    """An export wrote model.safetensors beside an earlier checkpoint's shards and index, which the importer (like
    transformers and vLLM) follows: the folder loaded as the earlier model, without a word."""
    old, new = _quantized(), _quantized()
    save_quantized(old, tmp_path / "d", format=fmt)
    _reshard(tmp_path / "d")
    (tmp_path / "d" / "quantize_config.json").write_text('{"bits": 4, "group_size": 128, "sym": true}')  # AutoGPTQ's
    (tmp_path / "d" / "quant_config.json").write_text('{"w_bit": 4, "q_group_size": 128}')  # early AutoAWQ's
    with pytest.warns(UserWarning, match="removed model-00001-of-00002.safetensors, model-00002-of-00002.safetensors, "
                                         "model.safetensors.index.json, quant_config.json, quantize_config.json from"):
        save_quantized(new, tmp_path / "d", format=fmt)
    assert sorted(p.name for p in (tmp_path / "d").glob("model*")) == ["model.safetensors"]
    save_quantized(new, tmp_path / "ref", format=fmt)
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(load_quantized(tmp_path / "d")[0](ids).logits, load_quantized(tmp_path / "ref")[0](ids).logits)


@pytest.mark.parametrize("fmt", ["nibble", "awq"])
def test_a_save_replaces_the_tokenizer_and_generation_config_an_earlier_save_left(tmp_path, fmt):
    """A tokenizer without a chat template saved where another's was kept that chat_template.jinja (nibble generate
    then prompted the model with another's template), or the earlier one's named templates (additional_chat_templates/),
    and a save without a tokenizer kept the earlier model's."""
    model = _quantized()
    save_quantized(model, tmp_path, _tokenizer(chat_template="{{ 'EARLIER MODEL' }}"), format=fmt)
    save_quantized(model, tmp_path, _tokenizer(), format=fmt)
    assert load_quantized(tmp_path)[1].chat_template is None
    save_quantized(model, tmp_path, _tokenizer(chat_template={"default": "{{ 'A' }}", "tool_use": "{{ 'EARLIER' }}"}),
                   format=fmt)
    save_quantized(model, tmp_path, _tokenizer(chat_template="{{ 'B' }}"), format=fmt)  # its named one is gone
    assert load_quantized(tmp_path)[1].chat_template == "{{ 'B' }}"
    model.generation_config = None
    save_quantized(model, tmp_path, format=fmt)
    loaded, tokenizer = load_quantized(tmp_path)
    assert tokenizer is None and not (tmp_path / "generation_config.json").exists()


@pytest.mark.parametrize("fmt", ["nibble", "awq"])
def test_every_file_of_a_save_is_readable_as_the_umask_allows(tmp_path, fmt, monkeypatch):
    """safetensors creates its file 0600: the weights of a checkpoint in a shared folder were the one file another
    user (a server) could not read."""
    monkeypatch.setattr(checkpoint_files, "_UMASK", 0o022)  # read once, at import
    umask = os.umask(0o022)
    try:
        save_quantized(_quantized(), tmp_path, _tokenizer(), format=fmt)
    finally:
        os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir() if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


def test_two_saves_of_a_model_are_the_same_bytes_and_old_checkpoints_load(saved, tmp_path):
    """safetensors orders several metadata keys anew each process (a hash map): the same model saved twice gave
    files that differed byte for byte. Checkpoints written with the earlier keys still load."""
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file
    model, path = saved
    code = ("import sys, torch; from nibble import load_quantized, save_quantized; "
            "m, _ = load_quantized(sys.argv[1]); save_quantized(m, sys.argv[2])")
    for out in ("a", "b"):  # separate processes: the hash map's seed differs between them
        subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / out)], check=True)
    a, b = ((tmp_path / out / "model.safetensors").read_bytes() for out in ("a", "b"))
    assert a == b == (path / "model.safetensors").read_bytes()
    from safetensors import safe_open
    with safe_open(path / "model.safetensors", "pt") as f:
        ours = json.loads(f.metadata()["nibble"])
    tensors = load_file(path / "model.safetensors")
    save_file(tensors, path / "model.safetensors",  # the metadata as session 55 wrote it: checksums of the data alone
              metadata={"format": "pt", "nibble_checksums": json.dumps({k: tensor_sha256(v, typed=False)
                                                                        for k, v in tensors.items()}),
                        "nibble_aliases": json.dumps(ours["aliases"])})
    loaded, _ = load_quantized(path)
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_generation_config_transformers_calls_invalid_is_kept(tmp_path):
    """Hub models ship flags GenerationConfig.save_pretrained refuses (a temperature without do_sample): the save
    failed after all the work, leaving no tokenizer."""
    import warnings

    from transformers import GenerationConfig
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.generation_config = GenerationConfig(do_sample=False, temperature=0.6, eos_token_id=[2, 7])
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    save_quantized(model, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded, _ = load_quantized(tmp_path)
    assert (loaded.generation_config.temperature, loaded.generation_config.eos_token_id) == (0.6, [2, 7])


@pytest.mark.parametrize("fmt", ["nibble", "awq"])
@pytest.mark.parametrize("damage,cause", [('{"eos_token_id": [2, ', "Expecting value"),
                                          ("[2, 7]", r"it holds \[2, 7\], not a JSON object"),
                                          ("null", "it holds null, not a JSON object"),
                                          ('{"max_new_tokens": -3}', "`max_new_tokens` must be greater than 0")])
def test_a_damaged_generation_config_is_named_and_ignored(tmp_path, fmt, damage, cause):
    """A cut file failed every load (nibble info's and eval's too, which generate nothing), and a list or a null
    with a TypeError traceback. It is said and ignored, as a chat template that cannot compile is: the model stops
    on config.json's eos_token_id."""
    from transformers import GenerationConfig
    model = _quantized()
    model.generation_config = GenerationConfig(eos_token_id=[2, 7])
    save_quantized(model, tmp_path, format=fmt)
    (tmp_path / "generation_config.json").write_text(damage)
    with pytest.warns(UserWarning, match=rf"{re.escape(str(tmp_path / 'generation_config.json'))} cannot be read "
                                         rf"\({cause}.*\), so it is ignored: .*; fix or delete that file"):
        loaded, _ = load_quantized(tmp_path)
    assert loaded.generation_config.eos_token_id == model.config.eos_token_id


@pytest.mark.parametrize("fmt", ["nibble", "awq"])
def test_a_compiled_model_is_saved_as_the_model_and_other_objects_are_refused(tmp_path, fmt):
    """torch.compile's wrapper saved every tensor as "_orig_mod....", which no load placed (the save went through, the
    load failed); the decoder alone (model.model) saved keys without "model.", and an Engine failed on .modules()."""
    from nibble import Engine
    model = _quantized()
    save_quantized(torch.compile(model), tmp_path / "compiled", format=fmt)
    save_quantized(model, tmp_path / "plain", format=fmt)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "compiled" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
    with pytest.raises(ValueError, match="nibble converts causal LMs .* got LlamaModel"):
        save_quantized(model.model, tmp_path / "decoder", format=fmt)
    with pytest.raises(TypeError, match="a save takes the model .*, got Engine"):
        save_quantized(Engine(model, max_seq_len=16), tmp_path / "engine", format=fmt)
    assert not (tmp_path / "decoder").exists() and not (tmp_path / "engine").exists()


def test_a_damaged_tokenizer_file_is_named(tmp_path):
    """A cut tokenizer.json failed every load with "Expecting value: line 3 column 17 (char 38)" alone, and a
    missing one with transformers' "Couldn't instantiate the backend tokenizer" list."""
    save_quantized(_quantized(), tmp_path, _tokenizer())
    f = tmp_path / "tokenizer.json"
    text = f.read_text()
    f.write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(f))} is not valid JSON \(.*\); re-download the model "
                                              "or save it again"):
        load_quantized(tmp_path)
    f.unlink()
    with pytest.raises(CheckpointError, match="holds tokenizer_config.json but not the tokenizer's vocabulary .*"
                                              r"tokenizer\.save_pretrained"):
        load_quantized(tmp_path)


@pytest.mark.parametrize("file,damage,message", [
    ("tokenizer_config.json", lambda c: [1, 2], r"tokenizer_config\.json holds \[1, 2\], not a JSON object"),
    ("tokenizer.json", lambda c: {k: v for k, v in c.items() if k != "model"}, r"\(Exception: Model missing\."),
    ("tokenizer_config.json", lambda c: {**c, "unk_token": 3}, r"\(TypeError: Special token unk_token has to be"),
    ("tokenizer_config.json", lambda c: {**c, "tokenizer_class": 3}, r"\(AttributeError: 'int' object")])
def test_a_tokenizer_file_of_the_wrong_shape_is_named(tmp_path, file, damage, message):
    """Valid JSON that is not what the file holds failed as a traceback (transformers' TypeError, KeyError or
    AttributeError, tokenizers' bare Exception) naming neither the file nor the folder."""
    save_quantized(_quantized(), tmp_path, _tokenizer())
    (tmp_path / file).write_text(json.dumps(damage(json.loads((tmp_path / file).read_text()))))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(tmp_path))}.*{message}"):
        load_quantized(tmp_path)


BROKEN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}"  # no endfor


@pytest.mark.parametrize("holder", ["chat_template.jinja", "additional_chat_templates/tool_use.jinja",
                                    "tokenizer_config.json"])
def test_a_chat_template_jinja_cannot_compile_is_said_on_load_naming_its_file(tmp_path, holder):
    """transformers compiles a chat template at its first use: a broken one loaded without a word, and failed `nibble
    generate --chat` at the first prompt. It is said as the model loads (which it still does)."""
    good = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    save_quantized(_quantized(), tmp_path, _tokenizer(chat_template={"default": good, "tool_use": good}))
    assert load_quantized(tmp_path)[1].chat_template == {"default": good, "tool_use": good}
    if holder == "tokenizer_config.json":  # the place of a template before transformers wrote .jinja files
        shutil.rmtree(tmp_path / "additional_chat_templates")  # read, where there are any, instead
        (tmp_path / "chat_template.jinja").unlink()
        config = json.loads((tmp_path / holder).read_text())
        (tmp_path / holder).write_text(json.dumps({**config, "chat_template": BROKEN_TEMPLATE}))
    else:
        (tmp_path / holder).write_text(BROKEN_TEMPLATE)
    with pytest.warns(UserWarning, match=rf"{re.escape(str(tmp_path / holder))}: its chat template.* cannot be "
                                         r"compiled \(.*'endfor'.*, line 1\): chat prompts that use it will fail"):
        assert load_quantized(tmp_path)[1] is not None


def _damaged(config, damage):
    if damage == "a list":
        return [1, 2]
    if damage == "null":
        return None
    if damage == "no model_type":
        del config["model_type"]
    elif damage == "qc a string":
        config["quantization_config"] = "awq"
    elif damage == "modules null":
        config["quantization_config"]["online_hadamard_modules"] = None
    elif damage == "permuted a string":  # a name where a list of them belongs: read as its characters
        config["quantization_config"]["input_permuted_modules"] = "model.layers.0.mlp.down_proj"
    elif damage == "mode unknown":
        config["quantization_config"]["mode"] = "w9"
    elif damage == "model_type unknown":
        config["model_type"] = "llama9"
    elif damage == "hidden_size a string":
        config["hidden_size"] = "64"
    return config


@pytest.mark.parametrize("damage,message", [
    ("a list", r"config\.json holds \[1, 2\], not a JSON object"),
    ("null", r"config\.json holds null, not a JSON object"),
    ("no model_type", r"config\.json names no model_type"),
    ("qc a string", r"config\.json: quantization_config must be an object, got 'awq'"),
    ("modules null", r"quantization_config\.online_hadamard_modules must be a list of module names, got None"),
    ("permuted a string", r"quantization_config\.input_permuted_modules must be a list of module names, got "
                          r"'model\.layers\.0\.mlp\.down_proj'"),
    ("mode unknown", r"config\.json: mode must be one of \('w4a16', 'w4a4'\), got 'w9'"),
    ("model_type unknown", r"config\.json: model_type 'llama9' is not supported; nibble loads the llama, qwen2"),
    ("hidden_size a string", r"config\.json: Validation error for field 'hidden_size': TypeError: .* expected int")])
def test_a_structurally_damaged_config_is_named(saved, damage, message):
    """A config.json that is valid JSON but not what a config holds failed with raw TypeError / AttributeError
    tracebacks ("pop expected at most 1 argument", "'str' object has no attribute 'get'") naming no file (nibble info
    too); a field transformers refuses failed as huggingface_hub's StrictDataclassError, and an unknown model_type
    with transformers' list of 300, a quantization_config field with no file named."""
    _, path = saved
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(_damaged(config, damage)))
    with pytest.raises(CheckpointError, match=message):
        load_quantized(path)


def test_a_resharded_nibble_checkpoint_is_named_as_such(saved):
    """Resharded by another tool: "model.safetensors is missing: not a nibble checkpoint directory", of a folder whose
    config.json says it is one."""
    _, path = saved
    _reshard(path)
    with pytest.raises(CheckpointError, match=r"holds shards \(model\.safetensors\.index\.json\), but a nibble "
                                              r"checkpoint is one model\.safetensors"):
        load_quantized(path)


UP = "model.layers.0.mlp.up_proj"
ROWS = r"model\.safetensors: model\.layers\.0\.mlp\.up_proj\."  # the refusal names the file and the layer


def _regrouped(path, edit, group_size):
    """A converter's file of the checkpoint ``path`` (checksums right, no config digest): its tensors as ``edit``
    changes them, under config.json's quantization_config.group_size ``group_size``."""
    _rewrite_tensors(path, edit, config_digest=False)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["group_size"] = group_size
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("parts,rows,group_size,refusal", [
    (("scales", "zeros"), 0, 32, ROWS + r"scales has shape \(0, 192\) and .*up_proj\.zeros has shape \(0, 192\), a row "
                                 r"per group of the layer's 64 inputs, but quantization_config.group_size 32 makes 2 of "
                                 "them"),
    (("scales", "zeros"), 3, 32, ROWS + r"scales has shape \(3, 192\) and .*group_size 32 makes 2 of them"),
    (("scales", "zeros"), 1, 32, ROWS + r"scales has shape \(1, 192\) and .*group_size 32 makes 2 of them"),
    (("zeros",), 1, 32, ROWS + r"zeros has shape \(1, 192\), a row per group .*group_size 32 makes 2 of them"),
    ((), 2, 40, r"model\.safetensors: model\.layers\.\d\.\S+\.scales has shape \(\d+, \d+\) and \S+\.zeros has shape "
                r"\(\d+, \d+\), a row per group of the layer's \d+ inputs, but quantization_config\.group_size 40 does not "
                "split them into groups"),  # every layer: the first one checked is refused
    (("missing scales",), 0, 32, r"model\.safetensors lacks 1 of the tensors of the model of its config\.json, e\.g\. "
                                 r"\['model\.layers\.0\.mlp\.up_proj\.scales'\]"),
])
def test_scales_or_zeros_of_other_groups_than_the_group_size_are_refused(saved, parts, rows, group_size, refusal):
    """A converter's file (checksums right, no config digest): 0 rows of scales was a ZeroDivisionError, 3 a group size
    of 42 that QuantLinear refused in its own words, and rows that split the inputs otherwise (or a group size edited
    into config.json) loaded as the group size the scales made, which a re-save or export wrote under the config's."""
    def edit(tensors):
        for part in parts:
            if part == "missing scales":
                del tensors[f"{UP}.scales"]
            else:
                tensors[f"{UP}.{part}"] = tensors[f"{UP}.{part}"][:1].repeat(rows, 1)

    _, path = saved
    _regrouped(path, edit, group_size)
    with pytest.raises(CheckpointError, match=refusal):
        load_quantized(path)


def test_scales_of_a_row_per_whole_group_of_a_group_size_that_does_not_split_the_inputs_are_refused(saved):
    """group_size 40 fits one whole group in 64 inputs (four in 192): scales and zeros of that many rows are no group
    size at all, refused as the checkpoint's fault, naming the file, not left to QuantLinear's own refusal."""
    def edit(tensors):
        for k in [k for k in tensors if k.endswith((".scales", ".zeros"))]:
            tensors[k] = tensors[k][:1].repeat(tensors[k].shape[0] * 32 // 40, 1)

    _, path = saved
    _regrouped(path, edit, 40)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: model\.layers\.\d\.\S+\.scales has shape \((1|4), "
                                              r"\d+\) .*quantization_config\.group_size 40 does not split them into "
                                              "groups"):
        load_quantized(path)


@pytest.mark.parametrize("fmt", ["nibble", "awq"])
def test_a_save_to_an_empty_name_or_a_file_is_refused_and_a_failed_write_named(tmp_path, fmt, monkeypatch):
    """"" wrote the checkpoint into the current folder, a file was a bare FileExistsError from pathlib, and a full
    disk safetensors' "I/O error: File too large", naming no file."""
    model = _quantized()
    for empty in ("", "  "):  # blank too: a folder named by spaces, where the user meant none
        with pytest.raises(ValueError, match="the directory to save to is empty"):
            save_quantized(model, empty, format=fmt)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="file is a file: a checkpoint is a folder"):
        save_quantized(model, tmp_path / "file", format=fmt)
    save_quantized(model, tmp_path / "q", format=fmt)
    before = (tmp_path / "q" / "model.safetensors").read_bytes()

    def full(tensors, path, metadata=None):
        open(path, "wb").close()
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint_files, "save_file", full)
    with pytest.raises(OSError, match=r"cannot write .*model\.safetensors \(.*No space left on device; a full disk\?\): "
                                      "what the folder held is unchanged"):
        save_quantized(model, tmp_path / "q", format=fmt)
    assert (tmp_path / "q" / "model.safetensors").read_bytes() == before and not list((tmp_path / "q").glob("*.tmp"))


@pytest.mark.parametrize("fmt", ["nibble", "awq"])
def test_ctrl_c_during_a_save_leaves_the_checkpoint_there_and_no_temporary(tmp_path, fmt, monkeypatch):
    """Ctrl-C while the weights were written left model.safetensors.tmp (173 MB for SmolLM2, gigabytes for a 7B
    model): the temporary was removed on a write error only."""
    model = _quantized()
    save_quantized(model, tmp_path / "q", format=fmt)
    before = (tmp_path / "q" / "model.safetensors").read_bytes()

    def interrupted(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint_files, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_quantized(model, tmp_path / "q", format=fmt)
    assert (tmp_path / "q" / "model.safetensors").read_bytes() == before and not list((tmp_path / "q").glob("*.tmp"))


@pytest.mark.parametrize("fmt", ["nibble", "awq", "gptq"])
def test_a_save_into_the_float_models_folder_is_refused_and_a_quantized_checkpoint_written_again(tmp_path, fmt):
    """load_model(D), quantize_model, save_quantized(model, D) replaced D's float weights and config.json without a
    word (nibble quantize refused --out D, the library did not), and a save into another float model's folder did the
    same. A quantized checkpoint's folder is one being written again, the one the model was loaded from too."""
    from nibble.models.hf_import import export_gptq
    from nibble.models.loading import load_model
    source = tmp_path / "float"
    tiny_model().save_pretrained(source)
    _tokenizer().save_pretrained(source)
    held = {p.name: p.read_bytes() for p in source.iterdir()}
    model, tokenizer = load_model(source)
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    (tmp_path / "link").symlink_to(source)
    refusal = (f"is the folder the model comes from \\({re.escape(str(source))}\\): writing the checkpoint there "
               "would replace its float weights; give another folder")
    for directory in (source, f"{source}/", tmp_path / "link"):
        with pytest.raises(ValueError, match=refusal):
            save_quantized(model, directory, tokenizer, format=fmt)
    with pytest.raises(ValueError, match=refusal):  # the exports called directly
        export_gptq(model, source)
    shutil.copytree(source, tmp_path / "other")
    with pytest.raises(ValueError, match="other holds a model that is not a quantized checkpoint .*: writing the "
                                         "checkpoint there would replace it; give another folder, or empty this one"):
        save_quantized(model, tmp_path / "other", tokenizer, format=fmt)
    assert {p.name: p.read_bytes() for p in source.iterdir()} == held
    save_quantized(model, tmp_path / "q", tokenizer, format=fmt)
    loaded, tokenizer = load_quantized(tmp_path / "q")
    assert loaded.name_or_path == str(source)  # what the checkpoint was made from, through the save and the load
    save_quantized(loaded, tmp_path / "q", tokenizer, format=fmt)
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(load_quantized(tmp_path / "q")[0](ids).logits, loaded(ids).logits)


@pytest.mark.parametrize("fmt", ["nibble", "awq", "gptq"])
def test_a_tokenizer_the_save_cannot_write_is_refused_before_anything_is_written(tmp_path, fmt):
    """save_quantized(model, DIR, "path/to/tokenizer") failed as "'str' object has no attribute 'save_pretrained'"
    once the weights were written: a folder without config.json, or new weights beside the earlier save's."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    model = _quantized()
    with pytest.raises(TypeError, match=r"^tokenizer must be a transformers tokenizer \(what load_model and "
                                        r"load_quantized return, written with its save_pretrained\) or None, got the "
                                        r"str '/tok': load it first, with transformers.AutoTokenizer."
                                        r"from_pretrained\('/tok'\)$"):
        save_quantized(model, tmp_path / "new", "/tok", format=fmt)
    assert not (tmp_path / "new").exists()
    save_quantized(model, tmp_path / "q", _tokenizer(), format=fmt)
    held = {p.name: p.read_bytes() for p in (tmp_path / "q").iterdir()}
    with pytest.raises(TypeError, match="got the Tokenizer Tokenizer"):  # tokenizers' own, not transformers'
        save_quantized(_quantized(), tmp_path / "q", Tokenizer(WordLevel({"a": 0}, unk_token="a")), format=fmt)
    assert {p.name: p.read_bytes() for p in (tmp_path / "q").iterdir()} == held


def test_a_save_interrupted_before_its_config_is_refused_whatever_it_wrote(tmp_path, monkeypatch):
    """config.json was written before the tokenizer: a save interrupted between them loaded the new weights with the
    earlier model's tokenizer (or its chat template) without a word. config.json is written last now."""
    first, second = _quantized(), _quantized()
    save_quantized(first, tmp_path, _tokenizer(chat_template="{{ 'EARLIER MODEL' }}"))
    second.config.rms_norm_eps = first.config.rms_norm_eps * 2  # another config.json

    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint_files, "save_companions", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_quantized(second, tmp_path, _tokenizer())
    with pytest.raises(CheckpointError, match="saved with another config than"):
        load_quantized(tmp_path)


@pytest.mark.parametrize("tensor", ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias"])
def test_a_value_the_asked_dtype_cannot_hold_is_refused_naming_the_tensor(tmp_path, tensor):
    """A bfloat16 checkpoint loaded with dtype=float16 cast 1e6 to Inf without a word, and the model answered NaN.
    (q_proj.bias: a quantized layer's own bias.)"""
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    with torch.no_grad():
        model.get_parameter(tensor).view(-1)[3] = 1e6
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    save_quantized(model, tmp_path)
    with pytest.raises(ValueError, match=rf"model\.safetensors: {re.escape(tensor)} holds 1 value\(s\) beyond "
                                         r"torch\.float16's range \(e\.g\. 999424\), which would load as Inf there .*"
                                         r"load the model in torch\.bfloat16 or torch\.float32"):
        load_quantized(tmp_path, dtype=torch.float16)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(load_quantized(tmp_path)[0](ids).logits, model(ids).logits)
        assert load_quantized(tmp_path, dtype=torch.float32)[0](ids).logits.isfinite().all()


@pytest.mark.parametrize("fmt", ["nibble", "awq"])
def test_a_model_of_meta_tensors_is_refused_before_anything_is_written(saved, tmp_path, fmt):
    """quantized_structure's model (what `nibble info` reads) failed the save as torch's "Cannot copy out of meta
    tensor; no data!", after the folder was made."""
    from nibble.models.serialization import quantized_structure

    with pytest.raises(ValueError, match=r"^the model holds tensors on the meta device \(quantized_structure's model"):
        save_quantized(quantized_structure(saved[1]), tmp_path / "again", format=fmt)
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("tensor", ["model.layers.0.mlp.down_proj.scales", "model.layers.1.self_attn.k_proj.zeros",
                                    "model.norm.weight"])
def test_a_nan_or_inf_in_a_checkpoint_is_refused_naming_the_tensor(tmp_path, tensor):
    """A NaN scale (a broken export, an edit whose checksums were written again) loaded without a word, and every
    logit was NaN; AutoAWQ / GPTQ imports refused it already."""
    model = _quantized()
    with torch.no_grad():
        model.state_dict()[tensor].view(-1)[1] = float("nan") if "norm" not in tensor else float("inf")
    save_quantized(model, tmp_path)
    with pytest.raises(ValueError, match=rf"model\.safetensors: {re.escape(tensor)} holds 1 NaN or Inf value\(s\): "
                                         "the checkpoint is corrupt"):
        load_quantized(tmp_path)


def test_a_model_of_another_quantizers_config_is_refused_nibbles_format(tmp_path):
    """A model whose quantization_config is another tool's (GPTQ's, as transformers loads a GPTQ checkpoint) holds no
    nibble layers: nibble's format would write it under a config that no load of nibble's reads."""
    model = tiny_model("llama")
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    with pytest.raises(ValueError, match="model has no nibble quantization_config: run nibble.quantize_model first"):
        save_quantized(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_the_structure_of_a_bfloat16_checkpoint_is_what_its_load_builds(tmp_path):
    """quantized_structure (`nibble info`) builds the model load_quantized builds on the CPU: a bfloat16 save loads
    in bfloat16 there, and so is its structure (not float32), each tensor's shape and dtype alike."""
    from nibble.models.serialization import quantized_structure
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    save_quantized(model, tmp_path)
    loaded, structure = load_quantized(tmp_path, tokenizer=False)[0], quantized_structure(tmp_path)
    shapes = {k: (v.shape, v.dtype) for k, v in loaded.state_dict().items()}
    assert {k: (v.shape, v.dtype) for k, v in structure.state_dict().items()} == shapes
    assert structure.model.embed_tokens.weight.dtype == torch.bfloat16


def test_weights_under_another_rotation_seed_are_refused(tmp_path):
    """The digest covers the quantization_config: two saves whose config.json differ in it alone (the seed of their
    rotation) do not take each other's weights."""
    import shutil
    for name, seed in (("old", 1), ("new", 2)):
        model = tiny_model("llama")
        quantize_model(model, QuantConfig(mode="w4a4", rotation="hadamard", rotation_seed=seed), progress=False)
        save_quantized(model, tmp_path / name)
    shutil.copy(tmp_path / "new" / "model.safetensors", tmp_path / "old" / "model.safetensors")
    with pytest.raises(CheckpointError, match="saved with another config than .*config.json holds"):
        load_quantized(tmp_path / "old")


def test_a_save_interrupted_before_its_config_is_written_again_and_another_tools_weights_are_not(tmp_path):
    """Weights that carry nibble's metadata without a config.json beside them are a nibble save interrupted before
    its config.json (written last): saving again there goes through. A folder of another tool's safetensors without
    a config.json is a model all the same, which a save would replace: refused."""
    from safetensors.torch import save_file
    model = _quantized()
    save_quantized(model, tmp_path / "q")
    (tmp_path / "q" / "config.json").unlink()
    save_quantized(model, tmp_path / "q")
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(load_quantized(tmp_path / "q")[0](ids).logits, model(ids).logits)
    (tmp_path / "float").mkdir()
    save_file({"w": torch.randn(4, 4)}, tmp_path / "float" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="float holds a model that is not a quantized checkpoint"):
        save_quantized(model, tmp_path / "float")


def test_load_quantized_without_the_tokenizer_reads_none_of_its_files(tmp_path):
    """tokenizer=False: the tokenizer saved beside the weights is neither loaded nor read (a damaged one does not
    stop a load that does not need it)."""
    save_quantized(_quantized(), tmp_path, _tokenizer())
    (tmp_path / "tokenizer.json").write_text("{ cut")
    model, tokenizer = load_quantized(tmp_path, tokenizer=False)
    assert tokenizer is None and model.config.quantization_config["quant_method"] == "nibble"


def test_a_chat_templates_folder_that_is_a_link_is_unlinked_and_its_target_left_alone(tmp_path):
    """A save owns the additional_chat_templates folder; where it is a link (to a template collection elsewhere),
    the link goes and what it points to stays: rmtree refused a link, and the save failed half written."""
    save_quantized(_quantized(), tmp_path / "q")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "tool.jinja").write_text("{{ 'TOOL' }}")
    (tmp_path / "q" / "additional_chat_templates").symlink_to(tmp_path / "elsewhere")
    save_quantized(_quantized(), tmp_path / "q", _tokenizer())
    assert not (tmp_path / "q" / "additional_chat_templates").is_symlink()
    assert (tmp_path / "elsewhere" / "tool.jinja").read_text() == "{{ 'TOOL' }}"
    assert load_quantized(tmp_path / "q")[1].chat_template is None


def test_the_weights_files_metadata_is_written_in_key_order(tmp_path, monkeypatch):
    """safetensors writes its metadata from a hash map, in another order each time (here the worst one, reversed):
    the same export differed byte for byte. It is rewritten in key order, whatever the header's padding."""
    real = checkpoint_files.save_file

    def reversed_order(tensors, path, metadata=None):
        real(tensors, path, metadata=metadata)
        with open(path, "r+b") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            header["__metadata__"] = dict(sorted(header["__metadata__"].items(), reverse=True))
            f.seek(8)
            f.write(json.dumps(header, separators=(",", ":")).encode().ljust(size))

    def metadata_keys(path):
        with open(path, "rb") as f:
            return list(json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"])
    monkeypatch.setattr(checkpoint_files, "save_file", reversed_order)
    for pad in range(8):  # one of these headers needs no padding: the rewrite is as long as the header then
        checkpoint_files._save_safetensors({"w": torch.randn(3, 5)}, tmp_path / "w.safetensors",
                                           {"format": "pt", "nibble": "x" * pad})
        assert metadata_keys(tmp_path / "w.safetensors") == ["format", "nibble"]
    save_quantized(_quantized(), tmp_path / "awq", format="awq")
    assert metadata_keys(tmp_path / "awq" / "model.safetensors") == ["format", "nibble"]


def test_an_unreadable_weights_file_is_a_permission_error_not_a_missing_one(saved, monkeypatch):
    """safetensors says "No such file or directory" of a file it may not read: the load names the permission. (As
    root every file is readable, so the refusal of os.access is what stands in for a chmod 000 here.)"""
    _, path = saved
    weights = path / "model.safetensors"
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False if str(p) == str(weights) else real_access(p, mode))
    with pytest.raises(PermissionError, match=rf"^cannot read {re.escape(str(weights))}: permission denied"):
        load_quantized(path)


def test_a_tensor_of_a_dtype_nibble_does_not_read_makes_the_structure_a_checkpoint_error(saved):
    """`nibble info` reads the headers alone (`quantized_structure`): a tensor stored as U16 was header_tensor's
    ValueError escaping the load's refusal of a damaged file."""
    from nibble.models.serialization import quantized_structure
    _, path = saved
    _rewrite_tensors(path, lambda tensors: tensors.update(
        {"model.norm.weight": torch.randint(0, 1000, (64,)).to(torch.uint16)}))
    with pytest.raises(CheckpointError, match=r"is truncated or corrupt \(tensor 'model\.norm\.weight' is stored as "
                                              r"U16, a dtype nibble does not read\)"):
        quantized_structure(path)


def test_a_refusal_names_a_field_that_held_an_empty_object():
    """An empty object spread into no dotted key at all: a field saved as {} and gone now was no change to name."""
    from nibble.models.checkpoint_files import config_changes, digested_config
    config = tiny_model("llama").config.to_dict()
    config["quantization_config"] = {"mode": "w4a16", "group_size": 32, "options": {}}
    saved = json.loads(json.dumps(digested_config(config), default=str))
    del config["quantization_config"]["options"]
    assert config_changes(saved, config) == "quantization_config.options {} when saved, absent now"


def test_an_lm_head_untied_under_a_tied_config_loads_as_saved(tmp_path):
    """A head given its own weight while config.json still says tie_word_embeddings is stored apart; the load keeps
    it rather than tying the embedding over it (which would change every logit)."""
    model = tiny_model("qwen2")
    assert model.config.tie_word_embeddings
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.02)
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    save_quantized(model, tmp_path)
    loaded, _ = load_quantized(tmp_path)
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_tokenizer_given_as_a_path_object_is_told_how_to_load_it():
    """A pathlib.Path is a path as much as a str: the refusal says how to load the tokenizer from it."""
    from pathlib import Path
    with pytest.raises(TypeError, match=r"got the \w*Path \w*Path\('/tok'\): load it first, with "
                                        r"transformers.AutoTokenizer.from_pretrained\('/tok'\)$"):
        checkpoint_files.check_tokenizer(Path("/tok"))


def test_a_nibble_quant_method_spelt_in_another_case_is_a_quantized_checkpoint_a_save_writes_again(tmp_path):
    """quant_method is read whatever its case, as the importer reads "AWQ": "Nibble" is a quantized checkpoint (the
    commands load it with load_quantized, which names the spelling), not a float model a save would refuse to
    replace."""
    model = _quantized()
    save_quantized(model, tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "Nibble"
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    assert checkpoint_files.quantized_checkpoint(tmp_path / "q")
    save_quantized(model, tmp_path / "q")
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(load_quantized(tmp_path / "q")[0](ids).logits, model(ids).logits)


def test_load_quantized_reads_a_directory_under_the_home_folder_as_a_shell_would(tmp_path, monkeypatch):
    """"~/model", as a script passes it unexpanded: the checkpoint under the home folder, not a folder named "~"."""
    model = _quantized()
    save_quantized(model, tmp_path / "q")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "q")  # where no "~" folder is
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(load_quantized("~/q")[0](ids).logits, model(ids).logits)


def test_a_save_into_a_float_model_folder_of_no_safetensors_is_refused(tmp_path):
    """A float model whose weights are pytorch_model.bin: its config.json is no interrupted nibble save (that leaves
    weights without a config.json), so the save refuses to replace it."""
    float_model = tiny_model("llama")
    (tmp_path / "float").mkdir()
    float_model.config.to_json_file(tmp_path / "float" / "config.json")
    torch.save(float_model.state_dict(), tmp_path / "float" / "pytorch_model.bin")
    held = {p.name: p.read_bytes() for p in (tmp_path / "float").iterdir()}
    with pytest.raises(ValueError, match="float holds a model that is not a quantized checkpoint"):
        save_quantized(_quantized(), tmp_path / "float")
    assert {p.name: p.read_bytes() for p in (tmp_path / "float").iterdir()} == held


def test_a_save_into_a_folder_of_unreadable_safetensors_without_a_config_is_refused(tmp_path):
    """safetensors that cannot be opened carry no nibble metadata to show they are an interrupted nibble save (whose
    writes are atomic: it never leaves a cut file): another model's, perhaps damaged, which a save would replace."""
    from safetensors.torch import save_file
    (tmp_path / "other").mkdir()
    save_file({"w": torch.randn(64, 64)}, tmp_path / "other" / "model.safetensors", metadata={"format": "pt"})
    weights = tmp_path / "other" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    held = weights.read_bytes()
    with pytest.raises(ValueError, match="other holds a model that is not a quantized checkpoint"):
        save_quantized(_quantized(), tmp_path / "other")
    assert weights.read_bytes() == held
