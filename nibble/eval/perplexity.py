"""Perplexity of a causal LM on a token stream, and the standard WikiText-2 protocol.

The protocol is the one behind the WikiText-2 numbers in the GPTQ / AWQ / QuaRot papers:

- text: the raw WikiText-2 *test* split as `"\\n\\n".join(HF rows)` (built from `wiki.test.raw`,
  see `wikitext2_text`), tokenized once with the tokenizer's default special tokens;
- windows: the stream is cut into non-overlapping windows of `seq_len` tokens; the ragged tail
  (fewer than `seq_len` tokens) is **dropped**;
- each window is scored on its own: its first token has no context, so a window predicts
  `seq_len - 1` tokens; `nll` is the mean token NLL over all predictions and `ppl = exp(nll)`.
  All windows predict equally many tokens, so this equals GPTQ's mean of per-window losses.
"""

import contextlib
import math
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from nibble.config import check_count, check_token_ids, resolve_device
from nibble.eval.data import DataFormatError, data_file, parsing
from nibble.eval.memory import format_bytes, memory_bound
from nibble.warn import warn

# Published WikiText-2 numbers use 2048-token windows; longer windows give lower perplexity
# that is not comparable with them.
DEFAULT_MAX_SEQ_LEN = 2048
WIKITEXT2_TEST = "wikitext2/wiki.test.raw"  # the data file every perplexity here is taken on
_LOG_FLOAT_MAX = math.log(sys.float_info.max)


def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of `text` from a Hugging Face tokenizer or a `tokenizers.Tokenizer`. A whole corpus is one text,
    cut into windows afterwards: transformers' warning that it is longer than the model's context ("will result in
    indexing errors") is silenced (``verbose``)."""
    quiet = {"verbose": False} if hasattr(tokenizer, "model_max_length") else {}
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens, **quiet)
    return list(getattr(ids, "ids", ids))  # `tokenizers` returns an Encoding


def model_device(model) -> torch.device:
    return next(model.parameters(), torch.empty(0)).device


def context_length(model) -> int | None:
    """The longest sequence the model was built for (`config.max_position_embeddings`), if known."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def model_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """`[batch, seq, vocab]` logits of a HF causal LM, or of any module that returns logits."""
    if isinstance(model, PreTrainedModel):
        # Without use_cache=False HF models fill a KV cache that nobody reads here.
        return model(input_ids, use_cache=False).logits
    out = model(input_ids)
    return getattr(out, "logits", out)


@contextlib.contextmanager
def eval_mode(model):
    """Score with dropout off (e.g. LoRA dropout right after QAT), then restore the caller's mode."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


def perplexity(model, token_ids, seq_len: int, batch_size: int = 1, device=None, progress: bool = True) -> dict:
    """Perplexity over non-overlapping `seq_len` windows of `token_ids` (ragged tail dropped).

    `token_ids` are integers of the model's vocabulary (others are refused). A `seq_len` beyond the model's context
    is clamped to it, with a warning.

    Returns dict(ppl, nll, tokens, windows, seq_len); `tokens` counts predicted tokens,
    i.e. `windows * (seq_len - 1)`. `device` is where the input ids go (default: the device of
    the model's first parameter; a given one is checked by `resolve_device`, as every entry point's). `progress`
    shows a bar of the windows done, where they take more than one forward pass.
    """
    check_count("batch_size", batch_size)  # windows per forward pass
    check_count("seq_len", seq_len, 2)  # a window predicts seq_len - 1 tokens; a float one failed as a slice's index
    ids = torch.as_tensor(token_ids).flatten()
    if ids.numel():  # an empty list is float32 to torch; the stream's length is said below
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:  # a float id was truncated
            raise ValueError(f"token_ids must be integer token ids, got {ids.dtype}")
        if hasattr(model, "get_input_embeddings"):  # else any module that returns logits: its vocabulary is its own
            check_token_ids(model, ids, "the stream's", "tokenize the text with this model's tokenizer")
    ids = ids.long()
    seq_len = _clamp_to_context(model, seq_len)
    n_windows = ids.numel() // seq_len
    if n_windows == 0:
        raise ValueError(
            f"The token stream has {ids.numel()} tokens, fewer than one window of seq_len={seq_len}; "
            "pass a smaller seq_len or more tokens."
        )
    device = resolve_device(device) if device is not None else model_device(model)
    check_logits_fit(model, min(batch_size, n_windows), seq_len, batch_size, device)
    windows = ids[: n_windows * seq_len].view(n_windows, seq_len)

    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    one_pass = n_windows <= batch_size  # a bar would sit at 0 for the whole pass, then jump to the end
    with (eval_mode(model),
          tqdm(total=n_windows, unit="window", desc="perplexity", disable=not progress or one_pass) as bar):
        for start in range(0, n_windows, batch_size):
            batch = windows[start : start + batch_size].to(device)
            logits = model_logits(model, batch)
            # One row at a time: a float32 copy of a whole batch of logits can be GBs.
            for row_logits, row in zip(logits, batch):
                nll_sum += F.cross_entropy(row_logits[:-1].float(), row[1:], reduction="sum").double()
            bar.update(len(batch))

    tokens = n_windows * (seq_len - 1)
    nll = nll_sum.item() / tokens
    # a mean NLL past float64's range of exp (~709.8: a model whose logits are huge, a broken quantization) is an
    # infinite perplexity: math.exp raised OverflowError, a traceback of `nibble eval ppl`, a failed report config
    ppl = math.inf if nll > _LOG_FLOAT_MAX else math.exp(nll)  # a NaN one (logits not finite) stays NaN
    return dict(ppl=ppl, nll=nll, tokens=tokens, windows=n_windows, seq_len=seq_len)


def check_logits_fit(model, rows: int, length: int, batch_size: int, device: torch.device, what: str = "windows",
                     too_long: str = "give a shorter seq_len") -> None:
    """Refuse a forward pass whose logits alone, ``rows`` x ``length`` x the vocabulary, exceed the device's memory
    (`memory_bound`), in the sizes' terms (``what`` the rows are; ``too_long``: the fix where one row exceeds it):
    `nibble eval ppl --batch-size 64` of SmolLM2 on a CPU of 23 GiB asked for 24 GiB of logits, and the kernel killed
    the process without a word. A model without a config's vocabulary or a dtype (any module that returns logits) is
    not checked."""
    vocab, dtype = getattr(getattr(model, "config", None), "vocab_size", None), getattr(model, "dtype", None)
    bound = memory_bound(device)
    if not isinstance(vocab, int) or not isinstance(dtype, torch.dtype) or bound is None:
        return
    per_row = length * vocab * dtype.itemsize
    if rows * per_row > bound[0]:
        # the model's weights and activations need memory too: no batch size is promised to fit, only one refused
        fix = (f"give a smaller batch_size (each of the {what}: {format_bytes(per_row)})" if per_row <= bound[0]
               else too_long)
        raise ValueError(f"a forward pass of {rows} {what} of {length} tokens (batch_size={batch_size}) makes "
                         f"{format_bytes(rows * per_row)} of logits ({vocab} {str(dtype).removeprefix('torch.')} "
                         f"values a token), more than {bound[1]}: {fix}")


def wikitext2_text() -> str:
    """WikiText-2 raw test as `"\\n\\n".join(HF rows)`, the text GPTQ-style evaluation tokenizes.

    `wiki.test.raw` holds the HF rows one per line, with empty rows written as `" \\n"`. A copy with Windows line
    ends (one of the file's two sources has them; a checkout with autocrlf makes them) reads as the same text: its
    "\\r" stayed in every row and moved the perplexity (15.75 for 15.15 on 2,048 tokens).
    """
    path = data_file(WIKITEXT2_TEST)
    with parsing(path):
        lines = path.read_bytes().decode("utf-8").replace("\r\n", "\n").split("\n")  # a lone "\r" is its row's
    rows = ["" if line == " " else line + "\n" for line in lines[:-1]] + [lines[-1]] * bool(lines[-1])
    if not "".join(rows).strip():  # it was blamed on a seq_len of 0, which the user never gave
        raise DataFormatError(f"{path}: no text in it; copy the file again from the shared data folder")
    return "\n\n".join(rows)


def default_seq_len(model, n_tokens: int) -> int:
    """The model's context, capped at 2048 (the published protocol) and at the stream length."""
    ctx = context_length(model)
    if ctx is None:
        raise ValueError("The model has no config.max_position_embeddings; pass seq_len explicitly.")
    return min(ctx, DEFAULT_MAX_SEQ_LEN, n_tokens)


def check_window(seq_len: int | None, max_tokens: int | None, names=("seq_len", "max_tokens"),
                 context: int | None = None) -> None:
    """Refuse a ``max_tokens`` cut shorter than one window, which would score nothing, before the work (the commands
    check it before the model loads: ``names`` are their options). The window is the one `perplexity` scores:
    ``seq_len`` clamped to the model's ``context`` (`context_length`) where it is given; a 4096-token window of a
    2048-context model, cut at 2048 tokens, scores one 2048-token window, and was refused."""
    if seq_len is None or max_tokens is None:
        return
    window = seq_len if context is None else min(seq_len, context)
    if max_tokens < window:
        clamped = f" (clamped to the model's context, {window})" if window < seq_len else ""
        raise ValueError(f"{names[1]} {max_tokens} is fewer tokens than one window of {names[0]} {seq_len}{clamped}: "
                         f"no window would be scored; give {names[1]} >= {window}, or a shorter {names[0]}")


def check_model_window(model_path, seq_len: int | None, max_tokens: int | None, names) -> None:
    """`check_window` against the context of the model that ``model_path`` names (as `load_model` and
    `load_quantized` take it: None is the default model), read from its config before the model loads."""
    if seq_len is not None and max_tokens is not None:  # its config is read only where there is a window to check
        from nibble.models.loading import model_context
        check_window(seq_len, max_tokens, names, model_context(model_path))


def _clamp_to_context(model, seq_len: int) -> int:
    ctx = context_length(model)
    if ctx is not None and seq_len > ctx:
        warn(f"seq_len={seq_len} exceeds the model's context ({ctx} = config.max_position_embeddings); using {ctx}.")
        return ctx
    return seq_len


def wikitext2_perplexity(
    model, tokenizer, seq_len=None, max_tokens=None, batch_size=1, device=None, progress=True
) -> dict:
    """WikiText-2 test perplexity (protocol in the module docstring).

    `max_tokens` keeps only the first tokens of the stream, for quick runs; without `seq_len`
    the window then shrinks to fit, so e.g. `max_tokens=1024` scores one 1024-token window.
    """
    # said here, before the text is tokenized: a max_tokens < 2 shrinks the window to what `perplexity` would refuse,
    # by another name, and a float one failed as a slice's index
    for name, value in (("seq_len", seq_len), ("max_tokens", max_tokens)):
        if value is not None:
            check_count(name, value, 2)  # a window of 2 tokens predicts one
    # The split is far longer than the model's context on purpose (it is cut into windows), so
    # HF's "sequence length is longer than the specified maximum" warning would only mislead.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        ids = encode(tokenizer, wikitext2_text(), add_special_tokens=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if seq_len is None:
        seq_len = default_seq_len(model, len(ids))
    return perplexity(model, ids, seq_len, batch_size=batch_size, device=device, progress=progress)
