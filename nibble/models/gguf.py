"""Read llama.cpp GGUF files (llama architecture) into a transformers model and tokenizer.

We read the tensors with the `gguf` package ourselves instead of calling transformers' GGUF
loader: that loader is about 3x slower, needs `accelerate`, and its tokenizer drops the
pre-tokenizer the file names in `tokenizer.ggml.pre` (SmolLM's digit splitting, for one).
"""
from __future__ import annotations

import functools
import re
import struct
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Iterable, NamedTuple

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.initialization import no_init_weights

from nibble.config import checked_cast
from nibble.models.convert import rebuild_non_persistent_buffers
from nibble.warn import warn

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor names -> transformers LlamaForCausalLM parameter names.
_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# Pre-tokenizers llama.cpp names in `tokenizer.ggml.pre`, rebuilt with the `tokenizers` library.
# Each must reproduce the original Hugging Face tokenizer exactly, so only verified ones are listed.
_PRE_TOKENIZERS = {
    # SmolLM / StarCoder: every digit is its own pre-token, then GPT-2's byte-level regex split.
    "smollm": lambda prefix: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True),
    ]),
    "gpt-2": lambda prefix: pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True),
}

Q4_1_GROUP = 32  # llama.cpp's QK4_1: weights per Q4_1 block, along K


class Q4_1Blocks(NamedTuple):
    """One Q4_1 tensor in nn.Linear orientation: ``W[n, k] = d[n, k // 32] * codes[n, k] + m[n, k // 32]``."""

    codes: torch.Tensor  # uint8 [N, K], values 0..15
    d: torch.Tensor  # float16 [N, K // 32], scale
    m: torch.Tensor  # float16 [N, K // 32], minimum (additive offset)


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A llama-architecture GGUF file as an eval-mode ``LlamaForCausalLM`` (weights dequantized
    to float32, then cast to ``dtype``; the rotary frequencies stay float32) and its tokenizer, chat template
    included."""
    path = Path(path)
    reader = _open(path)
    config = _llama_config(reader, path)
    # before the model: a tokenizer nibble cannot build (Llama 2's sentencepiece) is refused in a moment, not after
    # every weight was dequantized to float32
    tokenizer = _tokenizer(reader, path, config)
    # on the meta device (shapes, no memory): every parameter is replaced by the strict, assigning load below
    model = _empty_model(reader, path, config)
    state_dict = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, path)
        try:
            weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ValueError(f"{path}: tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which the "
                             f"installed gguf package (v{version('gguf')}) cannot dequantize; convert the model "
                             "to a float, Q8_0, Q4_x/Q5_x or K-quant GGUF") from None
        bad = int((~np.isfinite(weight)).sum())
        if bad:  # GGUF has no checksum: the model would answer NaN logits, found only at generation
            raise ValueError(f"{path}: tensor {tensor.name} holds {bad} NaN or Inf value(s): the file is corrupt; "
                             "download or convert it again")
        # The reader yields weights in ggml's [N, K] row order: already nn.Linear's [out, in].
        weight = np.require(weight.reshape(_torch_shape(tensor)), requirements="W")  # torch wants writable memory
        # cast now, not the model at the end: a float32 model beside the cast one at the peak
        state_dict[name] = checked_cast(_unpermute_qk(torch.from_numpy(weight), name, config), dtype,
                                        f"{path}: tensor {tensor.name}")
    if config.tie_word_embeddings:
        state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
    # assign: the parameters become these tensors (a copy into allocated ones held two models at the peak)
    model.load_state_dict(state_dict, strict=True, assign=True)
    model.tie_weights()  # assign gave the embedding and the head a Parameter each
    # the rotary inv_freq, a buffer the file does not hold, computed as LlamaForCausalLM(config) does on the CPU: in
    # float32, as transformers' from_pretrained keeps it whatever the dtype (in bfloat16 RoPE's angles drift with
    # the position), and bit for bit what a model built there held
    rebuild_non_persistent_buffers(model, "cpu")
    return model.eval(), tokenizer


def read_context_length(path: str | Path) -> int:
    """The context a GGUF file's model was built for (its ``llama.context_length``, the config's
    max_position_embeddings), read from the metadata alone: a check that needs it runs before the weights load (the
    parsed metadata is kept for `load_gguf`)."""
    path = Path(path)
    return _field(_open(path), "llama.context_length", path, kind=int)


def _empty_model(reader: gguf.GGUFReader, path: Path, config: LlamaConfig) -> LlamaForCausalLM:
    """The model the metadata describes, on the meta device (shapes, no memory), once every tensor of the file is
    checked to fit it: a file whose tensors are not that model is refused before a weight is made (one flipped byte,
    embedding_length 64 -> 10,420,288, built an 11 GB model for a 1.5 MB file, which the OOM killer ended). The
    layers it builds are at most the file's tensors."""
    if config.num_hidden_layers > len(reader.tensors):
        raise ValueError(f"{path}: block_count {config.num_hidden_layers}, but the file holds {len(reader.tensors)} "
                         "tensors: the file is corrupt or its metadata belongs to another model; download or convert "
                         "it again")
    # without the random init, which costs dispatch time on meta tensors too (twice the build's time with it)
    with torch.device("meta"), no_init_weights():
        model = LlamaForCausalLM(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    held = {"lm_head.weight"} if config.tie_word_embeddings else set()
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, path)
        _check_place(tensor, name, expected, config, path)  # before the Q/K unpermute, which a wrong shape fails
        held.add(name)
    missing = sorted(set(expected) - held)
    if missing:  # load_state_dict would say it as a traceback of its own
        raise ValueError(f"{path} lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}: the GGUF is "
                         "incomplete, or its architecture has tensors nibble's llama loader does not build")
    return model


def _check_place(tensor: gguf.ReaderTensor, name: str, expected: dict, config: LlamaConfig, path: Path) -> None:
    """Refuse a tensor the model the metadata describes has no place for, or of another shape than it implies, by
    name: load_state_dict said either as a traceback of its own (unexpected keys, a size mismatch)."""
    implies = (f"(block_count {config.num_hidden_layers}, embedding_length {config.hidden_size}, feed_forward_length "
               f"{config.intermediate_size}, head_count {config.num_attention_heads}, head_count_kv "
               f"{config.num_key_value_heads}, {config.vocab_size} tokens)")
    fix = "the file is corrupt or its metadata belongs to another model; download or convert it again"
    if name not in expected:
        raise ValueError(f"{path}: tensor {tensor.name} has no place in the model its metadata describes {implies}: {fix}")
    shape = _torch_shape(tensor)
    if shape != expected[name]:
        raise ValueError(f"{path}: tensor {tensor.name} is {'x'.join(map(str, shape))} but the metadata {implies} "
                         f"implies {'x'.join(map(str, expected[name]))}: {fix}")


def read_q4_1_blocks(path: str | Path, names: Iterable[str] | None = None) -> dict[str, Q4_1Blocks]:
    """The raw Q4_1 codes, scales and minimums of a GGUF file, keyed by transformers parameter name
    (e.g. ``model.layers.0.self_attn.q_proj.weight``), with llama.cpp's Q/K row permutation undone,
    so ``d * codes + m`` (float32) equals the matching weight of ``load_gguf(path)`` bit for bit.

    ``names`` (transformers or GGUF tensor names) picks tensors; by default every Q4_1 tensor.
    """
    path = Path(path)
    reader = _open(path)
    config = _llama_config(reader, path)
    by_name = {}
    for t in reader.tensors:
        by_name[t.name] = by_name[_hf_name(t.name, path)] = t
    if names is None:
        names = [t.name for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_1]
    blocks = {}
    for wanted in names:
        if wanted not in by_name:
            raise KeyError(f"{path} has no tensor {wanted!r}")
        tensor = by_name[wanted]
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            raise ValueError(f"{path}: tensor {tensor.name!r} is {tensor.tensor_type.name}, not Q4_1")
        name = _hf_name(tensor.name, path)
        codes, d, m = _decode_q4_1(tensor.data)
        blocks[name] = Q4_1Blocks(*(_unpermute_qk(torch.from_numpy(x), name, config) for x in (codes, d, m)))
    return blocks


def _decode_q4_1(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # A Q4_1 block is 20 bytes: fp16 d, fp16 m, then 16 bytes whose low nibbles hold
    # weights 0..15 of the block and whose high nibbles hold weights 16..31.
    n = data.shape[0]
    blocks = data.reshape(n, -1, 4 + Q4_1_GROUP // 2)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)
    return codes, d, m


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic bytes, whatever its name (a download cache's blob)."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _open(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not is_gguf(path):
        raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    stat = path.stat()
    try:
        reader = _read(path.resolve(), stat.st_dev, stat.st_ino, stat.st_ctime_ns, stat.st_mtime_ns, stat.st_size)
    # numpy's view of a short file, the header past its end, a key twice (gguf's KeyError); or gguf's refusal of a
    # version or a tensor type it does not know (llama.cpp adds them), which the message alone tells apart
    except (ValueError, IndexError, KeyError, struct.error) as e:
        raise ValueError(f"{path} cannot be read ({e}): it is truncated or corrupt (download or convert it again), or "
                         f"of a GGUF version or tensor type newer than the installed gguf package (v{version('gguf')}) "
                         "knows (upgrade it)") from e
    if reader.byte_order == "S":  # gguf's dequantize reads tensor bytes in this machine's order: all swapped
        other = {"little": "big", "big": "little"}[sys.byteorder]  # what byte_order "S" (swapped) says
        raise ValueError(f"{path} is a {other}-endian GGUF, but this machine is {sys.byteorder}-endian: its tensors "
                         "would be read with their bytes swapped. Convert it with llama.cpp's gguf_convert_endian.py "
                         f"(`gguf_convert_endian.py FILE {sys.byteorder}`)")
    parts = _field(reader, "split.count", path, 1, int)
    if parts > 1:  # the first part was "lacks N of the model's tensors", the others "general.architecture is missing"
        part = _field(reader, "split.no", path, 0, int)
        raise ValueError(f"{path} is part {part + 1} of a GGUF split into {parts} files, and nibble reads one file: "
                         "merge them with llama.cpp's `llama-gguf-split --merge FIRST_PART MERGED.gguf` and load that")
    arch = _field(reader, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; nibble loads GGUF files of "
                         f"architecture {', '.join(SUPPORTED_ARCHITECTURES)} (load other models from a local "
                         "Hugging Face directory instead)")
    return reader


class _Reader(gguf.GGUFReader):
    # GGUFReader parses metadata with one small slice of its np.memmap per value, and memmap's
    # per-slice bookkeeping makes reading a 49k-token vocabulary 3x slower than plain ndarray
    # views of the same mapping (no copy). If gguf renames `data`, this is merely not used.
    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = np.asarray(value)


@functools.lru_cache(maxsize=1)
def _read(path: Path, dev: int, ino: int, ctime_ns: int, mtime_ns: int, size: int) -> gguf.GGUFReader:
    # Parsing still costs seconds; load_gguf then read_q4_1_blocks on the same file (the
    # quantization workflow) parse it once. The reader is read-only, so sharing it is safe.
    # The stat fields key out a rewritten or replaced file: mtime and size alone served the old
    # model for another of the same size whose mtime was kept (cp -p, rsync -a, tar x); a
    # replacement is another inode, and ctime is set by every change (utime cannot set it back).
    return _Reader(path)


_REQUIRED = object()


_KINDS = {int: "an integer", float: "a number", str: "a string"}


def _field(reader: gguf.GGUFReader, key: str, path: Path, default=_REQUIRED, kind: type | None = None):
    """The value of metadata ``key``, else ``default``; ``kind``: the type it must have (int, float or str)."""
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"{path}: GGUF metadata key {key!r} is missing; the file is incomplete or not a "
                             "llama.cpp model file")
        return default
    try:
        value = field.contents()
    except UnicodeDecodeError as e:  # the gguf package's error names neither the file nor the key
        raise ValueError(f"{path}: GGUF metadata key {key!r} holds text that is not UTF-8 ({e}): the file is "
                         "corrupt; download or convert it again") from e
    # by name: LlamaConfig's validator named neither the file nor the key, and a list (head counts per layer, which
    # llama.cpp reads for some architectures) failed in _llama_config's checks as a TypeError
    if kind is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        raise ValueError(f"{path}: GGUF metadata key {key!r} holds {repr(value)[:60]}, not {_KINDS[kind]}: the file "
                         "is corrupt, or of a model LlamaForCausalLM cannot build")
    return value


def _llama_config(reader: gguf.GGUFReader, path: Path) -> LlamaConfig:
    def meta(key, default=_REQUIRED, kind=int):
        return _field(reader, f"llama.{key}", path, default, kind)

    rope_scaling = meta("rope.scaling.type", "none", str)
    if rope_scaling != "none":
        raise ValueError(f"{path}: rope scaling {rope_scaling!r} is not supported by nibble's GGUF loader; "
                         "load the original Hugging Face directory instead")
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    kv_heads = meta("attention.head_count_kv", heads)
    # said here: LlamaConfig refused them with its validator's error, or a division by zero came first
    if not (heads > 0 and kv_heads > 0 and heads % kv_heads == 0 and hidden % heads == 0):
        raise ValueError(f"{path}: head_count {heads} and head_count_kv {kv_heads} do not fit embedding_length "
                         f"{hidden} (head_count_kv must divide head_count, and head_count embedding_length): the "
                         "file's metadata is corrupt; download or convert it again")
    head_dim = meta("attention.key_length", hidden // heads)
    if meta("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings (rope.dimension_count != head dim {head_dim}) "
                         "are not supported by LlamaForCausalLM")
    tensor_names = {t.name for t in reader.tensors}
    return LlamaConfig(
        vocab_size=meta("vocab_size", None) or len(_tokens(reader, path)),
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=meta("context_length"),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", kind=float),
        # 10000 is llama.cpp's default when the file does not say.
        rope_parameters={"rope_type": "default", "rope_theta": meta("rope.freq_base", 10000.0, float)},
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", path, None, int),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id", path, None, int),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id", path, None, int),
        architectures=["LlamaForCausalLM"],
    )


def _hf_name(gguf_name: str, path: Path) -> str:
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _BLOCK_NAME_RE.fullmatch(gguf_name)
    if match and match[2] in _BLOCK_NAMES:
        return f"model.layers.{match[1]}.{_BLOCK_NAMES[match[2]]}.{match[3]}"
    raise ValueError(f"{path}: tensor {gguf_name!r} has no counterpart in transformers' LlamaForCausalLM; "
                     "nibble's GGUF loader reads plain llama models (no rope_freqs, MoE or extra tensors)")


def _torch_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-first (ggml's ne); torch wants them slowest-first.
    return tuple(int(n) for n in reversed(tensor.shape))


def _unpermute_qk(x: torch.Tensor, hf_name: str, config: LlamaConfig) -> torch.Tensor:
    # llama.cpp's converter reorders the rows of each Q/K head from HF's rotate-half layout
    # (first half, second half) to interleaved pairs; swap them back. A pure row permutation,
    # so it applies alike to weights, biases and per-row quantization blocks.
    if ".q_proj." in hf_name:
        n_head = config.num_attention_heads
    elif ".k_proj." in hf_name:
        n_head = config.num_key_value_heads
    else:
        return x
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


def _tokens(reader: gguf.GGUFReader, path: Path) -> list[str]:
    tokens = _field(reader, "tokenizer.ggml.tokens", path, None)
    if not tokens:  # llama.cpp's --no-vocab, or metadata stripped: said as such, not as a key missing
        raise ValueError(f"{path} holds no tokenizer (no tokenizer.ggml.tokens), and nibble builds a GGUF model's "
                         "tokenizer from it; load the original Hugging Face directory instead")
    return tokens


def _tokenizer(reader: gguf.GGUFReader, path: Path, config: LlamaConfig) -> PreTrainedTokenizerFast:
    def meta(key, default=_REQUIRED, kind=None):
        return _field(reader, f"tokenizer.ggml.{key}", path, default, kind)

    tokens = _tokens(reader, path)
    model, pre = meta("model"), meta("pre", "default")
    if model != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise ValueError(f"{path}: tokenizer {model!r} with pre-tokenizer {pre!r} is not supported; nibble builds "
                         f"GGUF tokenizers of model 'gpt2' (byte-level BPE) with pre-tokenizer "
                         f"{' or '.join(map(repr, _PRE_TOKENIZERS))}. Load the original Hugging Face directory instead")
    merges = [tuple(merge.split(" ", 1)) for merge in meta("merges")]
    try:
        tokenizer = Tokenizer(BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    except Exception as e:  # the tokenizers library raises Exception itself ("Token '!\"' out of vocabulary")
        raise ValueError(f"{path}: its tokenizer cannot be built ({e}): the file's tokenizer metadata is corrupt; "
                         "download or convert it again") from e
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre](bool(meta("add_space_prefix", False)))
    tokenizer.decoder = decoders.ByteLevel()
    types = meta("token_type", None)
    if types is None:  # optional, as in llama.cpp, which reads every token as NORMAL without it
        types = [gguf.TokenType.NORMAL] * len(tokens)
    elif len(types) != len(tokens):  # zip below read the shorter as all there is: the tokens past it as NORMAL
        raise ValueError(f"{path}: tokenizer.ggml.token_type holds {len(types)} types for its {len(tokens)} tokens: "
                         "the file's metadata is corrupt; download or convert it again")
    # CONTROL tokens (<|im_start|> ...) must never be split by BPE nor shown when decoding with
    # skip_special_tokens; USER_DEFINED ones are matched whole but are ordinary text.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, ty in zip(tokens, types) if ty == gguf.TokenType.CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, ty in zip(tokens, types) if ty == gguf.TokenType.USER_DEFINED])

    def token(key):
        index = meta(key, None, int)
        if index is not None and not 0 <= index < len(tokens):
            raise ValueError(f"{path}: tokenizer.ggml.{key} is {index}, beyond its {len(tokens)} tokens: the file's "
                             "metadata is corrupt; download or convert it again")
        return None if index is None else tokens[index]

    bos, eos = token("bos_token_id"), token("eos_token_id")
    # BOS before every text where the file says so, as llama.cpp adds it. EOS after every text
    # (tokenizer.ggml.add_eos_token) is not added: an EOS that ends a prompt tells a causal LM the text is over,
    # so it generates as after a finished document, and the perplexity stream (one text, the corpus) would end
    # in an EOS the text does not hold. llama.cpp does not add it there either: llama-cli refuses a decoder-only
    # model that sets it, as do llama-perplexity and llama-imatrix (GGML_ASSERT(!llama_vocab_get_add_eos(vocab)));
    # only an encoder's input (T5's) or an embedding's ends in it, and nibble runs neither.
    if meta("add_eos_token", False):
        warn(f"{path}: tokenizer.ggml.add_eos_token is true, which nibble ignores: an EOS after a prompt or a "
             "perplexity text would end it for a causal LM (llama.cpp refuses such a model for generation and "
             "perplexity); texts are tokenized without it")
    if meta("add_bos_token", False):
        if bos is None:  # the tokenizers library's TypeError named no file, no key
            raise ValueError(f"{path}: tokenizer.ggml.add_bos_token is true, but no tokenizer.ggml.bos_token_id says "
                             "which token: the file's metadata is corrupt; download or convert it again")
        # as transformers' Llama tokenizer adds it: before each text of a pair too
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, meta("bos_token_id"))])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos, eos_token=eos, unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template", path, None),
        model_max_length=config.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
