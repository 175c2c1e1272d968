"""GGUF loading: the shipped SmolLM2 Q4_1 file, and tiny synthetic GGUF files for the edge cases."""
import re
import warnings
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from tokenizers.pre_tokenizers import ByteLevel
from transformers import LlamaConfig, LlamaForCausalLM

from nibble.models.gguf import load_gguf, read_q4_1_blocks
from nibble.models.loading import default_model_path


@pytest.fixture(scope="module")
def smollm():
    return load_gguf(default_model_path())


def test_config_matches_smollm2_135m(smollm):
    model, tokenizer = smollm
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == len(tokenizer) == 49152
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert c.rope_parameters["rope_theta"] == 100000.0 and c.max_position_embeddings == 8192
    assert abs(c.rms_norm_eps - 1e-5) < 1e-9
    assert (c.bos_token_id, c.eos_token_id) == (1, 2)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert not model.training and model.dtype == torch.float32


def test_greedy_generation_knows_paris(smollm):
    model, tokenizer = smollm
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_chat_template_renders_and_generates(smollm):
    model, tokenizer = smollm
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def test_digits_split_individually_like_the_original_tokenizer(smollm):
    _, tokenizer = smollm
    assert tokenizer.tokenize("12345") == ["1", "2", "3", "4", "5"]
    assert tokenizer.tokenize("in 2024!") == ["in", "Ġ", "2", "0", "2", "4", "!"]
    # Digits are isolated before the byte-level regex runs, so the spaces ahead of one form a single
    # pre-token; a plain GPT-2 pre-tokenizer (transformers' GGUF tokenizer) gives ["x", "Ġ", "Ġ", "5"].
    assert tokenizer.tokenize("x  5") == ["x", "ĠĠ", "5"]
    ids = tokenizer("<|im_start|>user\nhi<|im_end|>").input_ids
    assert ids[0] == 1 and ids[-1] == 2  # control tokens stay whole
    assert tokenizer.decode(tokenizer("héllo  wörld\n日本").input_ids) == "héllo  wörld\n日本"
    # offsets as the original's (byte-level, untrimmed): a word's token covers the space before it
    assert tokenizer("hello world", return_offsets_mapping=True).offset_mapping == [(0, 5), (5, 11)]


def test_logits_match_transformers_gguf_loader(smollm):
    model, tokenizer = smollm
    path = default_model_path()
    try:
        from transformers import AutoModelForCausalLM
        reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except (ImportError, OSError) as e:
        pytest.skip(f"transformers' GGUF loader cannot run here: {e}")
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)


def test_q4_1_blocks_reproduce_every_linear_bit_exactly(smollm):
    model, _ = smollm
    blocks = read_q4_1_blocks(default_model_path())
    assert len(blocks) == 30 * 7  # every linear; the embedding is Q8_0
    weights = model.state_dict()
    for name, (codes, d, m) in blocks.items():
        n, k = codes.shape
        assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
        assert d.dtype == m.dtype == torch.float16 and d.shape == m.shape == (n, k // 32)
        w = codes.float().view(n, -1, 32) * d.float()[..., None] + m.float()[..., None]
        assert torch.equal(w.view(n, k), weights[name]), name


# --- tiny synthetic GGUF files --------------------------------------------------------------

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *sorted(ByteLevel.alphabet()), "he", "ll"]
TINY = LlamaConfig(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6)


def _permute(w, n_head):
    # What llama.cpp's convert_hf_to_gguf.py does to q/k rows; the loader must undo it.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, model, arch="llama", pre="smollm", add_bos=False, add_eos=False, quantized=False, extra=None,
                bos=1, merges=("h e", "l l"), head_counts=None, endianess=gguf.GGUFEndian.LITTLE, tokenizer="gpt2",
                metadata=None, token_types=True, split_max_tensors=0, rope_freq_base=True):
    """``quantized`` mimics the SmolLM2 file: Q4_1 linears, Q8_0 embedding tied to the output. ``head_counts``: the
    (head_count, head_count_kv) the metadata says, if not the model's. ``tokenizer``: the tokenizer.ggml.model said, None
    for none; only "gpt2" comes with tokens (the others with llama.vocab_size instead). ``metadata``: {key: value}
    written over the model's, a str as a string, a float as float32, an int as uint32 (int32 if negative), a bool as a
    bool, a list as an array. ``split_max_tensors``: split the file into parts of that many tensors each (llama.cpp's
    gguf-split), path-0000i-of-0000n.gguf.
    ``rope_freq_base``: write llama.rope.freq_base (which llama.cpp takes as optional, 10000 without it).
    ``token_types``: write tokenizer.ggml.token_type (the first three tokens CONTROL, the others NORMAL), which
    llama.cpp takes as optional."""
    c = model.config
    w = gguf.GGUFWriter(path, arch, endianess=endianess, split_max_tensors=split_max_tensors)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    heads, kv_heads = head_counts or (c.num_attention_heads, c.num_key_value_heads)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if c.head_dim != c.hidden_size // c.num_attention_heads:  # as llama.cpp's converter says a config's own head_dim
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if rope_freq_base:
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if tokenizer is not None:
        w.add_tokenizer_model(tokenizer)
    if tokenizer == "gpt2":
        w.add_tokenizer_pre(pre)
        w.add_token_list(TOKENS)
        if token_types:
            w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(TOKENS) - 3))
        w.add_token_merges(list(merges))
        if bos is not None:
            w.add_bos_token_id(bos)
        w.add_eos_token_id(2)
        w.add_add_bos_token(add_bos)
        if add_eos:
            w.add_add_eos_token(add_eos)
    else:
        w.add_vocab_size(c.vocab_size)
    for key, value in (metadata or {}).items():
        add_int = w.add_int32 if type(value) is int and value < 0 else w.add_uint32
        {str: w.add_string, float: w.add_float32, list: w.add_array, int: add_int,
         bool: w.add_bool}[type(value)](key, value)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in model.state_dict().items():
        array = tensor.numpy()
        if "q_proj" in name:
            array = _permute(array, c.num_attention_heads)
        elif "k_proj" in name:
            array = _permute(array, c.num_key_value_heads)
        if name not in names:
            i, part = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
            names[name] = f"blk.{i}.{parts[part]}.weight"
        if quantized and name == "lm_head.weight":
            continue
        qtype = None
        if quantized and name.endswith("proj.weight"):
            qtype = gguf.GGMLQuantizationType.Q4_1
        elif quantized and name == "model.embed_tokens.weight":
            qtype = gguf.GGMLQuantizationType.Q8_0
        if qtype is None:
            w.add_tensor(names[name], np.ascontiguousarray(array))
        else:
            w.add_tensor(names[name], gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    for name, array in (extra or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return LlamaForCausalLM(TINY).eval()


def test_tiny_roundtrip_undoes_qk_permutation(tiny, tmp_path):
    model, tokenizer = load_gguf(_write_gguf(tmp_path / "tiny.gguf", tiny, add_bos=True))
    assert not model.config.tie_word_embeddings  # the file has its own output.weight
    ids = tokenizer("hello 42", return_tensors="pt").input_ids
    assert tokenizer.convert_ids_to_tokens(ids[0]) == ["<|im_start|>", "he", "ll", "o", "Ġ", "4", "2"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tiny(ids).logits, rtol=0, atol=1e-6)
    assert load_gguf(tmp_path / "tiny.gguf", dtype=torch.bfloat16)[0].dtype == torch.bfloat16


def test_tiny_q4_1_blocks_match_loaded_weights(tiny, tmp_path):
    path = _write_gguf(tmp_path / "q4_1.gguf", tiny, quantized=True)
    model, _ = load_gguf(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    weights = model.state_dict()
    blocks = read_q4_1_blocks(path)
    assert len(blocks) == 2 * 7
    for name, (codes, d, m) in blocks.items():
        w = codes.float().view(codes.shape[0], -1, 32) * d.float()[..., None] + m.float()[..., None]
        assert torch.equal(w.view(codes.shape), weights[name]), name
    by_gguf_name = read_q4_1_blocks(path, ["blk.1.attn_k.weight"])
    torch.testing.assert_close(by_gguf_name["model.layers.1.self_attn.k_proj.weight"],
                               blocks["model.layers.1.self_attn.k_proj.weight"], rtol=0, atol=0)
    with pytest.raises(ValueError, match="Q8_0, not Q4_1"):
        read_q4_1_blocks(path, ["model.embed_tokens.weight"])
    with pytest.raises(KeyError, match="no tensor"):
        read_q4_1_blocks(path, ["model.layers.9.mlp.up_proj.weight"])


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    (tmp_path / "fake.gguf").write_text("hello")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(tmp_path / "fake.gguf")


def test_unsupported_architecture(tiny, tmp_path):
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported.*llama"):
        load_gguf(_write_gguf(tmp_path / "gpt2.gguf", tiny, arch="gpt2"))


def test_unsupported_tensor_type(tiny, tmp_path):
    # every attention bias, the tensors attn_q.bias implies, for the file to pass the check of its tensors' places
    biases = {f"blk.{i}.attn_{part}.bias": np.zeros(n, np.float32) for i in range(2)
              for part, n in (("q", 64), ("k", 32), ("v", 32), ("output", 64))}
    biases["blk.0.attn_q.bias"] = np.zeros(64, np.int32)
    path = _write_gguf(tmp_path / "i32.gguf", tiny, extra=biases)
    with pytest.raises(ValueError, match="stored as I32"):
        load_gguf(path)


def test_unknown_tensor(tiny, tmp_path):
    path = _write_gguf(tmp_path / "rope.gguf", tiny, extra={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="'rope_freqs.weight' has no counterpart"):
        load_gguf(path)


def test_unsupported_pre_tokenizer(tiny, tmp_path):
    with pytest.raises(ValueError, match="pre-tokenizer 'llama-bpe' is not supported"):
        load_gguf(_write_gguf(tmp_path / "bpe.gguf", tiny, pre="llama-bpe"))


def test_a_truncated_or_incomplete_gguf_is_named_in_one_line(tiny, tmp_path):
    """A cut file gave numpy's "When changing to a larger dtype..." and a missing tensor load_state_dict's traceback."""
    data = _write_gguf(tmp_path / "whole.gguf", tiny).read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: int(len(data) * 0.6)])
    # one flipped byte makes a key twice: gguf's KeyError("Duplicate tokenizer.ggml.eos_token_id") named no file
    (tmp_path / "twice.gguf").write_bytes(data.replace(b"tokenizer.ggml.bos_token_id", b"tokenizer.ggml.eos_token_id"))
    for name in ("cut", "twice"):
        with pytest.raises(ValueError, match=rf"{name}\.gguf cannot be read \(.*\): it is truncated or corrupt "
                                             r"\(download or convert it again\)"):
            load_gguf(tmp_path / f"{name}.gguf")
    state = {k: v for k, v in tiny.state_dict().items() if k != "model.layers.1.mlp.down_proj.weight"}
    fewer = SimpleNamespace(config=tiny.config, state_dict=lambda: state)
    with pytest.raises(ValueError, match=r"fewer\.gguf lacks 1 of the model's tensors, e.g. "
                                         r"\['model\.layers\.1\.mlp\.down_proj\.weight'\]"):
        load_gguf(_write_gguf(tmp_path / "fewer.gguf", fewer))


def test_a_file_replaced_by_another_of_the_same_size_and_time_is_read_anew(tiny, tmp_path):
    """The parsed reader was cached by path, mtime and size: a file replaced by another model of the same size whose
    mtime was kept (cp -p, rsync -a, tar x) loaded as the model it replaced."""
    import os
    import shutil
    path = _write_gguf(tmp_path / "a.gguf", tiny)
    first, _ = load_gguf(path)
    torch.manual_seed(1)
    other = _write_gguf(tmp_path / "b.gguf", LlamaForCausalLM(TINY).eval())
    stat = path.stat()
    shutil.copyfile(other, tmp_path / "new")
    os.utime(tmp_path / "new", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(tmp_path / "new", path)
    assert path.stat().st_size == stat.st_size
    second, _ = load_gguf(path)
    assert not torch.equal(second.model.embed_tokens.weight, first.model.embed_tokens.weight)
    assert torch.equal(second.model.embed_tokens.weight, load_gguf(other)[0].model.embed_tokens.weight)


def test_a_file_rewritten_in_place_with_its_size_and_time_is_read_anew(tiny, tmp_path):
    """cp -p onto an existing file rewrites it in place: the same inode, size and mtime, only its ctime tells it was
    changed. The cached reader's parsed fields still pointed at the old file's layout (a chat template of one
    character read as the first character of the new one's two)."""
    import os
    path = _write_gguf(tmp_path / "a.gguf", tiny, metadata={"tokenizer.chat_template": "A", "general.name": "xy"})
    assert load_gguf(path)[1].chat_template == "A"
    other = _write_gguf(tmp_path / "b.gguf", tiny, metadata={"tokenizer.chat_template": "AB", "general.name": "x"})
    stat = path.stat()
    with open(path, "r+b") as f:  # in place: the same inode
        f.write(other.read_bytes())
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_ino, path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_ino, stat.st_size,
                                                                                  stat.st_mtime_ns)
    assert load_gguf(path)[1].chat_template == "AB"


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_weight_is_refused_naming_the_tensor(tiny, tmp_path, value):
    """A NaN in one weight loaded, and the model answered NaN logits (token 0 again and again) at generation."""
    weights = {k: v.clone() for k, v in tiny.state_dict().items()}
    weights["model.layers.0.mlp.down_proj.weight"][5, 7] = value
    damaged = SimpleNamespace(config=tiny.config, state_dict=lambda: weights)
    with pytest.raises(ValueError, match=r"bad\.gguf: tensor blk\.0\.ffn_down\.weight holds 1 NaN or Inf value\(s\): the "
                                         "file is corrupt"):
        load_gguf(_write_gguf(tmp_path / "bad.gguf", damaged))


def _with_config(model, **overrides):
    """``model``'s tensors under metadata that says ``overrides``."""
    config = LlamaConfig(**{**model.config.to_dict(), **overrides})
    return SimpleNamespace(config=config, state_dict=model.state_dict)


@pytest.mark.parametrize("damage,message", [
    (dict(num_hidden_layers=1), r"tensor blk\.1\.\w+\.weight has no place in the model its metadata describes "
                                r"\(block_count 1, .*\): the file is corrupt or its metadata belongs to another model"),
    (dict(intermediate_size=128), r"tensor blk\.0\.ffn_gate\.weight is 96x64 but the metadata \(.*feed_forward_length "
                                  r"128.*\) implies 128x64: the file is corrupt"),
    (dict(head_counts=(3, 1)), r"head_count 3 and head_count_kv 1 do not fit embedding_length 64"),
    (dict(head_counts=(0, 0)), r"head_count 0 and head_count_kv 0 do not fit embedding_length 64"),
    (dict(head_counts=(0, 2)), r"head_count 0 and head_count_kv 2 do not fit embedding_length 64"),
    (dict(head_counts=(4, 3)), r"head_count 4 and head_count_kv 3 do not fit embedding_length 64")])
def test_metadata_that_disagrees_with_the_tensors_is_named(tiny, tmp_path, damage, message):
    """Raw load_state_dict tracebacks (unexpected keys, size mismatches), huggingface_hub's validation error, a
    division by zero or a reshape error, in place of the file and what disagrees."""
    overrides = {k: v for k, v in damage.items() if k != "head_counts"}
    path = _write_gguf(tmp_path / "bad.gguf", _with_config(tiny, **overrides), head_counts=damage.get("head_counts"))
    with pytest.raises(ValueError, match=message):
        load_gguf(path)


@pytest.mark.parametrize("kwargs,message", [
    (dict(bos=999), r"tokenizer\.ggml\.bos_token_id is 999, beyond its \d+ tokens: the file's metadata is corrupt"),
    (dict(bos=len(TOKENS)), rf"tokenizer\.ggml\.bos_token_id is {len(TOKENS)}, beyond its {len(TOKENS)} tokens"),
    (dict(metadata={"tokenizer.ggml.padding_token_id": -1}), r"tokenizer\.ggml\.padding_token_id is -1, beyond its"),
    (dict(bos=None, add_bos=True), r"tokenizer\.ggml\.add_bos_token is true, but no tokenizer\.ggml\.bos_token_id "
                                   r"says which token: the file's metadata is corrupt"),
    (dict(merges=["h e", "q! zz"]), r"its tokenizer cannot be built \(.*\): the file's tokenizer metadata is corrupt"),
    (dict(token_types=False, metadata={"tokenizer.ggml.token_type": [3, 3, 3]}),
     r"tokenizer\.ggml\.token_type holds 3 types for its \d+ tokens: the file's metadata is corrupt")])
def test_a_tokenizer_the_metadata_cannot_build_is_named(tiny, tmp_path, kwargs, message):
    """IndexError: list index out of range, the tokenizers library's "Error while initializing BPE", and its TypeError
    "Expected Union[Tuple[str, int], Tuple[int, str], dict]" for a BOS to add that no token id names; fewer token types
    than tokens read the tokens past them as NORMAL, without a word."""
    with pytest.raises(ValueError, match=rf"bad\.gguf: {message}"):
        load_gguf(_write_gguf(tmp_path / "bad.gguf", tiny, **kwargs))


def test_metadata_text_that_is_not_utf8_is_named(tiny, tmp_path):
    """A flipped byte in a token's text: gguf's UnicodeDecodeError named neither the file nor the key."""
    path = _write_gguf(tmp_path / "bad.gguf", tiny)
    data = bytearray(path.read_bytes())
    at = data.index(b"<|im_start|>")
    data[at + 2] = 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"bad\.gguf: GGUF metadata key 'tokenizer\.ggml\.tokens' holds text that "
                                         r"is not UTF-8"):
        load_gguf(path)


@pytest.mark.parametrize("name", ["MODEL.GGUF", "blob"])
def test_a_gguf_is_known_by_its_magic_bytes_not_its_suffix(tiny, tmp_path, name):
    """An upper-case suffix, or a download cache's blob, was "neither a .gguf file nor a Hugging Face model
    directory"."""
    from nibble.models.loading import load_model
    from nibble.models.gguf import is_gguf
    model, _ = load_model(_write_gguf(tmp_path / name, tiny))
    assert torch.equal(model.model.embed_tokens.weight, tiny.model.embed_tokens.weight)
    assert not is_gguf(tmp_path) and not is_gguf(tmp_path / "missing")  # no file: no GGUF, not an OSError


def test_a_big_endian_gguf_is_refused_not_read_with_its_bytes_swapped(tiny, tmp_path):
    """gguf hands a big-endian file's tensors (llama.cpp's --bigendian, for s390x) to a dequantize that reads their
    bytes in this machine's order: the F32 norms loaded as 4.6e-41 instead of 1.0, a model of garbage, without a word."""
    path = _write_gguf(tmp_path / "be.gguf", tiny, quantized=True, endianess=gguf.GGUFEndian.BIG)
    for read in (load_gguf, read_q4_1_blocks):
        with pytest.raises(ValueError, match=r"be\.gguf is a big-endian GGUF, but this machine is little-endian.*"
                                             r"gguf_convert_endian\.py"):
            read(path)


def test_a_tokenizer_nibble_cannot_build_is_refused_before_any_weight_is_read(tiny, tmp_path, monkeypatch):
    """The tokenizer was built last: a Llama 2 or Mistral GGUF (a sentencepiece tokenizer, which nibble does not build)
    had the whole model allocated and dequantized to float32 first (28 GB for a 7B model), to be refused after it, if
    the memory lasted."""
    import nibble.models.gguf as nibble_gguf
    path = _write_gguf(tmp_path / "bpe.gguf", tiny, pre="llama-bpe")
    monkeypatch.setattr(nibble_gguf, "LlamaForCausalLM", lambda config: pytest.fail("the model was built"))
    with pytest.raises(ValueError, match="pre-tokenizer 'llama-bpe' is not supported"):
        load_gguf(path)


@pytest.mark.parametrize("tokenizer", [None, "no_vocab"])
def test_a_gguf_without_a_tokenizer_is_named_as_such(tiny, tmp_path, tokenizer):
    """A file converted without its vocabulary (llama.cpp's --no-vocab writes tokenizer.ggml.model 'no_vocab') was
    "metadata key 'tokenizer.ggml.model' is missing; the file is incomplete or not a llama.cpp model file", or a
    tokenizer 'no_vocab' that nibble "does not support"."""
    with pytest.raises(ValueError, match=r"novocab\.gguf holds no tokenizer \(no tokenizer\.ggml\.tokens\).*load the "
                                         "original Hugging Face directory instead"):
        load_gguf(_write_gguf(tmp_path / "novocab.gguf", tiny, tokenizer=tokenizer))


@pytest.mark.parametrize("key,value,kind", [
    ("llama.block_count", "2", "an integer"), ("llama.attention.head_count", 4.0, "an integer"),
    ("llama.attention.head_count_kv", [2, 2], "an integer"), ("llama.attention.layer_norm_rms_epsilon", "1e-6", "a number"),
    ("tokenizer.ggml.eos_token_id", "2", "an integer"), ("tokenizer.ggml.bos_token_id", 1.0, "an integer"),
    ("tokenizer.ggml.unknown_token_id", "0", "an integer"),
    ("tokenizer.ggml.bos_token_id", True, "an integer")])  # a bool is no token id, though Python's bool is an int
def test_metadata_of_the_wrong_type_is_named(tiny, tmp_path, key, value, kind):
    """huggingface_hub's StrictDataclassFieldValidationError ("Field 'num_hidden_layers' expected int, got str"), naming
    neither the file nor the key, and a per-layer list of head counts (llama.cpp's reader takes one) a TypeError."""
    path = _write_gguf(tmp_path / "bad.gguf", tiny, metadata={key: value})
    with pytest.raises(ValueError, match=rf"bad\.gguf: GGUF metadata key '{re.escape(key)}' holds "
                                         rf"{re.escape(repr(value))}, not {kind}: the file is corrupt"):
        load_gguf(path)


@pytest.mark.parametrize("field", ["version", "tensor type"])
def test_a_gguf_newer_than_the_gguf_package_is_not_called_corrupt(tiny, tmp_path, field):
    """A GGUF version or a tensor type (llama.cpp adds them) the installed gguf package does not know was "truncated or
    corrupt ...; download or convert it again": advice that fetches the same file again."""
    import struct
    data = bytearray(_write_gguf(tmp_path / "new.gguf", tiny).read_bytes())
    if field == "version":
        struct.pack_into("<I", data, 4, 4)  # after the magic
    else:
        name = b"blk.0.ffn_up.weight"  # then its dimension count, dimensions (8 bytes each) and type
        at = data.index(name) + len(name)
        struct.pack_into("<I", data, at + 4 + 8 * struct.unpack_from("<I", data, at)[0], 99)
    (tmp_path / "new.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"new\.gguf cannot be read \(.*\): it is truncated or corrupt \(download or "
                                         r"convert it again\), or of a GGUF version or tensor type newer than the "
                                         r"installed gguf package \(v[\d.]+\) knows \(upgrade it\)"):
        load_gguf(tmp_path / "new.gguf")


@pytest.mark.parametrize("key,value", [("embedding_length", 10_420_288), ("block_count", 1 << 25)])
def test_metadata_made_huge_is_refused_before_the_model_is_allocated(tiny, tmp_path, monkeypatch, key, value):
    """One flipped byte made embedding_length 64 10,420,288 (found by flipping header bytes): load_gguf built the model
    that metadata describes before it compared a tensor with it, 11 GB for a 1.5 MB file, and the OOM killer ended
    the process. A block_count as wrong built 33 million layers."""
    import nibble.models.gguf as nibble_gguf
    path = _write_gguf(tmp_path / "huge.gguf", tiny)
    data = bytearray(path.read_bytes())
    at = data.index(f"llama.{key}".encode()) + len(f"llama.{key}") + 4  # past the name: its type, then its value
    data[at: at + 4] = value.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    built = nibble_gguf.LlamaForCausalLM
    monkeypatch.setattr(nibble_gguf, "LlamaForCausalLM", lambda config: built(config) if str(torch.empty(0).device)
                        == "meta" else pytest.fail("a model of the metadata's size was allocated"))
    with pytest.raises(ValueError, match=r"huge\.gguf: .*the file is corrupt or its metadata belongs to another model"):
        load_gguf(path)


def test_the_model_holds_the_dequantized_weights_not_copies_of_them(tiny, tmp_path, monkeypatch):
    """load_state_dict copied every dequantized weight into parameters allocated beforehand: two float32 models at
    the peak (1.6 GB for the 135M SmolLM2, 1.1 GB without the copy) and half the load time."""
    import nibble.models.gguf as nibble_gguf
    made, unpermute = set(), nibble_gguf._unpermute_qk

    def recorded(*args):  # what the state dict is made of, q/k unpermuted or not
        out = unpermute(*args)
        made.add(out.data_ptr())
        return out
    monkeypatch.setattr(nibble_gguf, "_unpermute_qk", recorded)
    model, _ = load_gguf(_write_gguf(tmp_path / "q.gguf", tiny, quantized=True))
    assert {p.data_ptr() for p in model.parameters()} <= made
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_float32_gguf_loads_into_writable_weights(tiny, tmp_path):
    """A float32 tensor dequantizes to a view of the file's read-only mapping: torch warned that it was not writable,
    and the model's weights were that mapping, which no in-place change (a rotation, a training step) may write."""
    path = _write_gguf(tmp_path / "t.gguf", tiny)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, _ = load_gguf(path)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2)
    torch.testing.assert_close(model.model.layers[0].mlp.up_proj.weight, 2 * tiny.model.layers[0].mlp.up_proj.weight,
                               rtol=0, atol=0)


def test_a_bfloat16_load_never_holds_the_float32_model(tiny, tmp_path, monkeypatch):
    """load_gguf dequantized every weight to float32 and cast the whole model at the end: a float32 and a bfloat16
    model at the peak (1.37 GB RSS for SmolLM2 in bfloat16, 0.89 GB casting each weight as it is made)."""
    import weakref

    import nibble.models.gguf as nibble_gguf
    made, most_alive, unpermute = [], [0], nibble_gguf._unpermute_qk

    def recorded(*args):  # each float32 weight as it is made, and how many made before are still held
        most_alive[0] = max(most_alive[0], sum(ref() is not None for ref in made))
        out = unpermute(*args)
        made.append(weakref.ref(out))
        return out
    monkeypatch.setattr(nibble_gguf, "_unpermute_qk", recorded)
    model, _ = load_gguf(_write_gguf(tmp_path / "q.gguf", tiny, quantized=True), dtype=torch.bfloat16)
    assert most_alive[0] == 0 and len(made) == len(tiny.state_dict()) - 1  # the tied head is not made
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_bfloat16_load_keeps_the_rotary_frequencies_in_float32(tiny, tmp_path):
    """load_gguf cast the whole model, its rotary inv_freq buffer too: RoPE angles off by a relative 2^-9, which grows
    with the position (SmolLM2's logits at positions 2000-3000 a mean KL of 0.0017 from the float32 model's against
    0.0014), where transformers' from_pretrained, and nibble's load_quantized, keep the frequencies in float32."""
    path = _write_gguf(tmp_path / "tiny.gguf", tiny)
    model, _ = load_gguf(path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.equal(model.model.rotary_emb.inv_freq, load_gguf(path)[0].model.rotary_emb.inv_freq)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_a_gguf_without_token_types_loads_its_tokens_as_normal_ones(tiny, tmp_path):
    """tokenizer.ggml.token_type is optional in llama.cpp, which reads every token as NORMAL without it; nibble refused
    such a file as "metadata key 'tokenizer.ggml.token_type' is missing"."""
    model, tokenizer = load_gguf(_write_gguf(tmp_path / "untyped.gguf", tiny, token_types=False))
    typed = load_gguf(_write_gguf(tmp_path / "typed.gguf", tiny))[1]
    # matched whole: the CONTROL tokens, and the BOS and EOS the file names (transformers makes those special)
    assert set(typed.backend_tokenizer.get_added_tokens_decoder()) == {0, 1, 2}
    assert set(tokenizer.backend_tokenizer.get_added_tokens_decoder()) == {1, 2}
    ids = tokenizer("hello 42", return_tensors="pt").input_ids
    assert ids.tolist() == typed("hello 42", return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tiny(ids).logits, rtol=0, atol=1e-6)


def test_control_tokens_are_special_and_user_defined_ones_whole_text(tiny, tmp_path):
    """tokenizer.ggml.token_type: a CONTROL token (<|endoftext|>, here neither BOS nor EOS, which transformers makes
    special anyway) is matched whole and dropped by skip_special_tokens; a USER_DEFINED one ("ll" here, which no
    merge builds) is matched whole too, but is text, which decoding keeps."""
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(TOKENS) - 4) + [gguf.TokenType.USER_DEFINED]
    _, tokenizer = load_gguf(_write_gguf(tmp_path / "t.gguf", tiny, merges=("h e",), token_types=False,
                                         metadata={"tokenizer.ggml.token_type": [int(t) for t in types]}))
    ids = tokenizer("<|endoftext|>hello").input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == ["<|endoftext|>", "he", "ll", "o"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello"


def test_a_head_dim_other_than_hidden_over_heads_is_read_from_attention_key_length(tmp_path):
    """A llama whose config sets head_dim (32 here, not 64 / 4): a loader that took hidden / heads refused the file
    (its q rows are 4 * 32, not 64)."""
    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(**{**TINY.to_dict(), "head_dim": 32})).eval()
    model, _ = load_gguf(_write_gguf(tmp_path / "head_dim.gguf", source))
    assert model.config.head_dim == 32
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_is_built_on_the_meta_device_and_its_rotary_frequencies_computed_as_on_the_cpu(tiny, tmp_path,
                                                                                                 monkeypatch, dtype):
    """A float32 model was allocated for the load to replace every parameter of (its memory never used: 23 MB more
    peak RSS for SmolLM2). Built on the meta device, the model's rotary frequencies, which no file holds, are computed
    after the load: bit for bit those of a model built on the CPU, in float32 whatever the dtype."""
    import nibble.models.gguf as nibble_gguf
    built = nibble_gguf.LlamaForCausalLM
    monkeypatch.setattr(nibble_gguf, "LlamaForCausalLM", lambda config: built(config) if str(torch.empty(0).device)
                        == "meta" else pytest.fail("a model was allocated"))
    model, tokenizer = load_gguf(_write_gguf(tmp_path / "tiny.gguf", tiny), dtype=dtype)
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    for name, buffer in tiny.model.rotary_emb.named_buffers():
        assert torch.equal(getattr(model.model.rotary_emb, name), buffer) and buffer.dtype == torch.float32, name
    if dtype == torch.float32:  # the same weights and frequencies: the same logits, bit for bit
        ids = tokenizer("hello 42", return_tensors="pt").input_ids
        with torch.no_grad():
            assert torch.equal(model(ids).logits, tiny(ids).logits)


def test_a_chat_template_that_cannot_compile_is_said_as_the_gguf_loads(tiny, tmp_path):
    """A HF folder's broken template was said as it loaded, a GGUF's only at the first chat prompt, as a traceback."""
    from nibble.models.loading import load_model
    path = _write_gguf(tmp_path / "t.gguf", tiny, metadata={"tokenizer.chat_template": "{% if messages %}x"})
    with pytest.warns(UserWarning, match=rf"^{re.escape(str(path))}: its chat template \(tokenizer\.chat_template\) "
                                         r"cannot be compiled \(.*'endif'.*\): chat prompts that use it will fail"):
        assert load_model(path)[1] is not None


def test_the_bos_the_gguf_says_to_add_begins_every_text(tiny, tmp_path):
    _, tokenizer = load_gguf(_write_gguf(tmp_path / "t.gguf", tiny, add_bos=True))
    text = ["he", "ll", "o"]
    assert tokenizer.convert_ids_to_tokens(tokenizer("hello").input_ids) == ["<|im_start|>", *text]
    pair = tokenizer("hello", "hello")
    assert tokenizer.convert_ids_to_tokens(pair.input_ids) == ["<|im_start|>", *text] * 2
    assert tokenizer.convert_ids_to_tokens(tokenizer("hello", add_special_tokens=False).input_ids) == text


@pytest.mark.parametrize("add_bos", [True, False])
def test_a_gguf_that_says_add_eos_token_ends_no_prompt_nor_perplexity_stream_with_eos(tiny, tmp_path, monkeypatch,
                                                                                     add_bos):
    """tokenizer.ggml.add_eos_token made every text end in EOS: a `generate --no-chat` prompt, which the model then
    continued as a finished document, and the perplexity stream. llama.cpp refuses such a decoder-only model for
    generation and perplexity; nibble tokenizes without the EOS, and says so."""
    import nibble.eval.perplexity as perplexity
    from nibble.cli import _prompt_ids

    path = _write_gguf(tmp_path / "t.gguf", tiny, add_bos=add_bos, add_eos=True)
    with pytest.warns(UserWarning, match=r"t\.gguf: tokenizer\.ggml\.add_eos_token is true, which nibble ignores"):
        model, tokenizer = load_gguf(path)
    bos = ["<|im_start|>"] * add_bos
    assert tokenizer.convert_ids_to_tokens(_prompt_ids(tokenizer, "hello", chat=False)) == [*bos, "he", "ll", "o"]
    streams = []
    monkeypatch.setattr(perplexity, "wikitext2_text", lambda: "hello hello hello")
    monkeypatch.setattr(perplexity, "perplexity", lambda model, ids, seq_len, **kwargs: streams.append(ids))
    perplexity.wikitext2_perplexity(model, tokenizer, seq_len=4)
    assert tokenizer.convert_ids_to_tokens(streams[0])[:len(bos) + 3] == [*bos, "he", "ll", "o"]
    assert tokenizer.eos_token_id not in streams[0] and tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("per_part,parts", [(10, 3), (11, 2)])
def test_a_part_of_a_split_gguf_is_refused_saying_to_merge_the_parts(tiny, tmp_path, per_part, parts):
    """The first part of a GGUF that llama.cpp's gguf-split cut in parts "lacks 10 of the model's tensors: the GGUF is
    incomplete, or its architecture has tensors nibble's llama loader does not build", the others "general.architecture
    is missing; the file is incomplete or not a llama.cpp model file"."""
    _write_gguf(tmp_path / "t.gguf", tiny, split_max_tensors=per_part)
    for part in range(1, parts + 1):
        path = tmp_path / f"t-0000{part}-of-0000{parts}.gguf"
        for read in (load_gguf, read_q4_1_blocks):
            with pytest.raises(ValueError, match=rf"t-0000{part}-of-0000{parts}\.gguf is part {part} of a GGUF split "
                                                 rf"into {parts} "
                                                 r"files, and nibble reads one file: merge them with llama\.cpp's "
                                                 r"`llama-gguf-split --merge"):
                read(path)


def test_a_value_the_asked_dtype_cannot_hold_is_refused_naming_the_tensor(tiny, tmp_path):
    """A float32 weight of 1e6 loaded with dtype=float16 became Inf without a word, and the model answered NaN."""
    weights = {k: v.clone() for k, v in tiny.state_dict().items()}
    weights["model.norm.weight"][5] = 1e6
    path = _write_gguf(tmp_path / "big.gguf", SimpleNamespace(config=tiny.config, state_dict=lambda: weights))
    with pytest.raises(ValueError, match=r"big\.gguf: tensor output_norm\.weight holds 1 value\(s\) beyond "
                                         r"torch\.float16's range \(e\.g\. 1e\+06\), which would load as Inf there"):
        load_gguf(path, dtype=torch.float16)
    assert load_gguf(path, dtype=torch.bfloat16)[0].model.norm.weight[5] == 999424  # bfloat16's nearest


def test_a_gguf_without_a_rope_base_takes_llama_cpps_default(tiny, tmp_path):
    """llama.rope.freq_base is optional: without it llama.cpp runs RoPE with base 10000, and so must the model."""
    model, _ = load_gguf(_write_gguf(tmp_path / "t.gguf", tiny, rope_freq_base=False))
    assert model.config.rope_parameters["rope_theta"] == 10000.0


@pytest.mark.parametrize("metadata,message", [
    ({"llama.rope.dimension_count": 8}, r"partial rotary embeddings \(rope\.dimension_count != head dim 16\) are not "
                                        "supported"),
    ({"llama.rope.scaling.type": "linear"}, r"rope scaling 'linear' is not supported by nibble's GGUF loader")])
def test_rotary_embeddings_the_loader_cannot_build_are_refused(tiny, tmp_path, metadata, message):
    """rope.dimension_count below the head dim rotates part of each head, which LlamaForCausalLM cannot: loaded, it
    rotated the whole head, another model. A rope scaling (linear, yarn) stretches the positions, which the config
    the loader builds would not: another model past the original context."""
    path = _write_gguf(tmp_path / "t.gguf", tiny, metadata=metadata)
    with pytest.raises(ValueError, match=message):
        load_gguf(path)


def test_a_gguf_that_says_add_space_prefix_tokenizes_a_text_as_after_a_space(tiny, tmp_path):
    """tokenizer.ggml.add_space_prefix: the byte-level pre-tokenizer puts a space before each text, as llama.cpp
    does: "hello" is tokenized as " hello" is without it."""
    plain = load_gguf(_write_gguf(tmp_path / "plain.gguf", tiny))[1]
    prefixed = load_gguf(_write_gguf(tmp_path / "prefixed.gguf", tiny,
                                     metadata={"tokenizer.ggml.add_space_prefix": True}))[1]
    assert prefixed("hello").input_ids == plain(" hello").input_ids != plain("hello").input_ids


@pytest.mark.parametrize("pre,number", [("gpt-2", ["Ġ42"]), ("smollm", ["Ġ", "4", "2"])])
def test_the_pre_tokenizer_splits_as_gpt_2s_regex_does(tiny, tmp_path, pre, number):
    """Both pre-tokenizers split words, spaces and punctuation by GPT-2's byte-level regex (SmolLM's each digit on its
    own first): without the regex a text was one piece, and merges ran across words."""
    tokenizer = load_gguf(_write_gguf(tmp_path / "t.gguf", tiny, pre=pre))[1]
    pieces = [piece for piece, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("hello world 42!")]
    assert pieces == ["hello", "Ġworld", *number, "!"]


def test_the_q4_1_blocks_of_a_file_without_a_tokenizer_are_read(tiny, tmp_path):
    """read_q4_1_blocks needs the model's shapes, not its tokenizer: a file that says llama.vocab_size and holds no
    tokens (llama.cpp's --no-vocab) gives its blocks, as they load in a file with a tokenizer."""
    bare = read_q4_1_blocks(_write_gguf(tmp_path / "bare.gguf", tiny, quantized=True, tokenizer=None))
    full = read_q4_1_blocks(_write_gguf(tmp_path / "full.gguf", tiny, quantized=True))
    assert bare.keys() == full.keys() and len(bare) == 7 * TINY.num_hidden_layers
    assert all(torch.equal(x, y) for name in bare for x, y in zip(bare[name], full[name]))


def test_the_special_tokens_the_file_names_are_the_models_and_its_tokenizers(tiny, tmp_path):
    """tokenizer.ggml.bos / eos / padding_token_id are the config's token ids (generate stops and pads by them) and,
    with unknown_token_id, the tokenizer's special tokens."""
    model, tokenizer = load_gguf(_write_gguf(tmp_path / "t.gguf", tiny, metadata={
        "tokenizer.ggml.padding_token_id": 4, "tokenizer.ggml.unknown_token_id": 5}))
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (1, 2, 4)
    special = [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token]
    assert special == [TOKENS[i] for i in (1, 2, 4, 5)]


def test_the_tokenizer_knows_the_context_the_file_says(tiny, tmp_path):
    """model_max_length is llama.context_length, as the model's max_position_embeddings: without it transformers'
    default (1e30) let a tokenizer cut nothing at the model's context."""
    model, tokenizer = load_gguf(_write_gguf(tmp_path / "t.gguf", tiny))
    assert tokenizer.model_max_length == model.config.max_position_embeddings == TINY.max_position_embeddings
