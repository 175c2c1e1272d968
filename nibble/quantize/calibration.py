"""Calibration data for GPTQ/AWQ, and the block-by-block walk both use to see activations.

``calibration_batches`` cuts a calibration text (C4 excerpt or a Gutenberg book from the shared
data folder, or any .txt/.jsonl file) into ``n_samples`` random non-overlapping windows of
``seq_len`` tokens. A text holding WikiText-2 test (the evaluation set) is refused, by its content.

Memory: the walk never holds more than one decoder block's activations. ``capture_block_inputs``
runs the model only up to block 0 (past stand-ins, to the first block of each attention type) and keeps
block 0's input hidden states (n_samples x seq_len x hidden, e.g. 32 x 512 x 576 fp32 = 38 MB for
SmolLM2-135M); each block is then run on them
(``forward_block``, with hooks that reduce what a linear sees to a K x K Hessian and a K-vector of
mean |x|, never storing the activations), and its outputs become the next block's inputs
(``quantize_blocks``, the walk itself, which each quantizer gives its own body).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from nibble.config import check_count
from nibble.kernels.hadamard import hadamard_transform
from nibble.models.architecture import DECODER_LAYERS, check_calibration, decoder_layers, decoder_layers_replaced

SOURCES = {"c4": "c4/c4_demo.jsonl", "gutenberg": "gutenberg/pg1342_pride_and_prejudice.txt"}
DEFAULT_SOURCE = "c4"
DEFAULT_SEQ_LEN = 512
# Lines of WikiText-2 test at least this long are taken as its own: its paragraphs are tokenized (" @-@ ", a space
# before each comma) as no other text is, and one of them does not recur by chance
_EVALUATION_LINE = 200


# What a calibration text of the user's own must hold (said where one does not)
OWN_TEXT = ('a calibration text of your own is a .txt file of UTF-8 text, or a .jsonl file of one JSON object a line '
            'with its text as a string in a "text" field: {"text": "..."}')


def calibration_text(source: str = DEFAULT_SOURCE) -> str:
    """The raw calibration text: ``"c4"``, ``"gutenberg"`` or a path to a .txt / .jsonl (``{"text": ...}`` per line)."""
    from nibble.eval.data import COPY_AGAIN, DataFormatError, data_file, parsing, read_jsonl
    if source in SOURCES:
        path, fix = data_file(SOURCES[source]), COPY_AGAIN
    else:
        source_data_files([source])  # refuses a path that is no file
        path, fix = Path(source).expanduser(), OWN_TEXT  # the shared folder's copies are no help with it
    if path.suffix == ".jsonl":
        records = read_jsonl(path, fix, fields=("text",))
        with parsing(path, fix):
            text = "\n\n".join(r["text"] for r in records)
    else:
        with parsing(path, fix):
            text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is no text: it was tokenized as such
    if not text.strip():  # it trained on windows of blanks without a word
        raise DataFormatError(f"{path}: holds no text, only whitespace; {fix}")
    if source not in SOURCES:
        check_not_evaluation_text(text, path)
    return text


def check_not_evaluation_text(text: str, path: Path) -> None:
    """Refuse a calibration ``text`` (read from ``path``) that holds paragraphs of WikiText-2 test, the data folder's
    copy that every perplexity is taken on (nothing to compare with where it is missing). By content, not by name: a
    copy of it under another name calibrated without a word, while WikiText-2 *train* (wiki.train.raw, the usual
    calibration text) and any path holding "wikitext2" were refused as the test set."""
    from nibble.eval.data import data_file
    from nibble.eval.perplexity import WIKITEXT2_TEST
    try:
        test = data_file(WIKITEXT2_TEST)
    except FileNotFoundError:
        return
    paragraphs = {line.strip() for line in test.read_text(encoding="utf-8").splitlines()}
    shared = sum(1 for line in text.splitlines()
                 if len(stripped := line.strip()) >= _EVALUATION_LINE and stripped in paragraphs)
    if shared:
        raise ValueError(f"refusing to calibrate on {path}: it holds WikiText-2 test, the evaluation set ({shared} "
                         f"paragraph{'s' * (shared > 1)} of {test}); calibrating on it would inflate every perplexity "
                         "we report. Use source='c4' or 'gutenberg', or a text of your own without it (WikiText-2 "
                         "train is fine).")


def calibration_batches(tokenizer, n_samples: int = 128, seq_len: int = DEFAULT_SEQ_LEN, source: str = DEFAULT_SOURCE,
                        seed: int = 0) -> torch.Tensor:
    """``n_samples`` random non-overlapping windows of ``seq_len`` tokens: LongTensor [n_samples, seq_len].

    The text is tokenized once (no special tokens) and cut into consecutive windows, of which a
    seeded random subset is taken. Raises ValueError naming the minimum (n_samples * seq_len tokens)
    when the source is too short.
    """
    if n_samples < 1 or seq_len < 2:
        raise ValueError(f"need n_samples >= 1 and seq_len >= 2, got n_samples={n_samples}, seq_len={seq_len}")
    from nibble.eval.perplexity import encode
    ids = torch.tensor(encode(tokenizer, calibration_text(source), add_special_tokens=False), dtype=torch.long)
    windows = ids.numel() // seq_len
    if windows < n_samples:
        raise ValueError(f"calibration source {source!r} has {ids.numel()} tokens, too short for n_samples={n_samples} "
                         f"windows of seq_len={seq_len}: that needs at least {n_samples * seq_len} tokens. "
                         f"Use fewer samples (it holds n_samples={windows} at this seq_len), shorter windows or a "
                         "longer text.")
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(windows, generator=g)[:n_samples].sort().values
    return ids[: windows * seq_len].reshape(windows, seq_len)[pick].contiguous()


def calibration_for(config, tokenizer, model: nn.Module | None = None, **sizes) -> torch.Tensor | None:
    """The calibration `quantize_model` needs for ``config``: None for RTN (or no config), else
    `calibration_batches` of ``tokenizer``, by default 128 x 512 tokens of the C4 excerpt (``sizes``:
    its ``n_samples`` / ``seq_len`` instead). With the ``model``, default windows are cut to its context where that
    is shorter; quantize_model refuses windows past it."""
    if config is None or config.method == "rtn":
        return None
    if model is not None and "seq_len" not in sizes:
        from nibble.eval.perplexity import context_length
        sizes["seq_len"] = min(DEFAULT_SEQ_LEN, context_length(model) or DEFAULT_SEQ_LEN)
    return calibration_batches(tokenizer, **sizes)


def calibration_files(method: str | None) -> list[str]:
    """The shared-data files `calibration_for` reads for a config of ``method`` (none for RTN), for
    `nibble.eval.data.require_data` to check before a model loads."""
    return [] if method in (None, "rtn") else source_data_files([DEFAULT_SOURCE])


def source_data_files(sources) -> list[str]:
    """The shared-data files of calibration ``sources`` (names in SOURCES); a source that is neither such a name
    nor a file is refused here, before any work."""
    missing = [s for s in sources if s not in SOURCES and not Path(s).expanduser().is_file()]
    if missing:
        raise FileNotFoundError(f"calibration source{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}: "
                                f"neither one of {sorted(SOURCES)} nor a file")
    return [SOURCES[s] for s in sources if s in SOURCES]


def token_batches(calib, batch_size: int) -> list[torch.Tensor]:
    """Normalise calibration input (LongTensor [n, L], a list of such tensors / of 1-D tensors, or a
    dict with ``input_ids``) to a list of LongTensor batches of at most ``batch_size`` rows."""
    check_count("batch_size", batch_size)
    if isinstance(calib, dict):
        calib = calib["input_ids"]
    if isinstance(calib, torch.Tensor):
        rows = [calib] if calib.dim() == 2 else [calib.unsqueeze(0)]
    else:
        rows = [torch.as_tensor(c).reshape(-1, torch.as_tensor(c).shape[-1]) for c in calib]
    if not rows or sum(r.shape[0] for r in rows) == 0:
        raise ValueError("calibration data is empty")
    out = []
    for r in rows:
        out += list(r.long().split(batch_size))
    return out


class _Stop(Exception):
    pass


def layer_prefix(i: int) -> str:
    """Decoder layer i's full name, as ``named_modules`` gives it (the prefix of its linears' names)."""
    return f"{DECODER_LAYERS}.{i}"


class _StandIn(nn.Module):
    """Decoder layer i while `capture_block_inputs` runs the model: records what the model hands it, passes the
    hidden states on, and stops the forward after the last layer whose arguments are wanted."""

    def __init__(self, i: int, record):
        super().__init__()
        self.i, self.record = i, record

    def forward(self, hidden_states, **kwargs):
        self.record(self.i, hidden_states, kwargs)
        return hidden_states


@torch.no_grad()
def capture_block_inputs(model: nn.Module, calib, batch_size: int = 8):
    """Run the model up to its first decoder block on every calibration batch, in eval mode (dropout off).

    Returns ``(inputs, kwargs)``: per batch, block 0's input hidden states; ``kwargs[i]``, per batch, the
    keyword arguments the model passes to block i (rotary position embeddings, mask, ...). Blocks of one
    attention type get the same ones, but a model whose ``config.layer_types`` mixes full and sliding-window
    attention (a Qwen2 with ``max_window_layers`` below its depth) gives each type its own mask: the model runs
    up to the first block of every type, each block replaced by a `_StandIn` meanwhile, so no block computes
    (nor needs to be on the embedding's device).
    """
    device = model.get_input_embeddings().weight.device  # the layers may still be elsewhere (offloaded)
    layers = decoder_layers(model)
    types = list(getattr(model.config, "layer_types", None) or [None] * len(layers))[:len(layers)]
    first = {types.index(t): t for t in dict.fromkeys(types)}  # block -> the type it is the first of
    last = max(first)
    inputs, by_type = [], {t: [] for t in first.values()}

    def record(i, hidden_states, kwargs):
        if i == 0:
            inputs.append(hidden_states)
        if i in first:
            by_type[first[i]].append(dict(kwargs))
        if i == last:
            raise _Stop

    training = model.training
    with decoder_layers_replaced(model, nn.ModuleList(_StandIn(i, record) for i in range(len(layers)))):
        try:
            model.eval()
            for batch in token_batches(calib, batch_size):
                try:
                    model(batch.to(device), use_cache=False)
                except _Stop:
                    pass
        finally:
            model.train(training)
    return inputs, [by_type[t] for t in types]


@contextmanager
def in_place(i: int, layer: nn.Module):
    """The calibrated quantizers' default ``onload(i, layer)``: decoder layer i as it is, and the dict that
    receives its quantized weights. ``quantize_model`` passes its own, which moves each layer to the GPU,
    rotates it and converts it at its turn (``nibble.models.convert.layer_turns``)."""
    yield layer, {}


class InputStats:
    """Running statistics of a linear layer's input x (rows of [tokens, K]): XtX = sum x^T x, sum |x|, count."""

    def __init__(self):
        self.xtx, self.abs_sum, self.n = None, None, 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        if self.xtx is None:
            self.xtx = torch.zeros(x.shape[1], x.shape[1], device=x.device)
            self.abs_sum = torch.zeros(x.shape[1], device=x.device)
        self.xtx.addmm_(x.t(), x)
        self.abs_sum += x.abs().sum(0)
        self.n += x.shape[0]

    @property
    def hessian(self) -> torch.Tensor:
        """H = 2/n X^T X, the Hessian of the layer-output squared error with respect to one weight row."""
        return self.xtx * (2.0 / self.n)

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / self.n


def check_statistics(*stats: torch.Tensor) -> None:
    """Refuse statistics of a linear's calibration inputs (its Hessian, mean |x|) that are not finite: every
    candidate's error was then NaN, and GPTQ blamed the amount of calibration data (its damping), AWQ the weights
    or nothing (``raise None``). The quantizers call it under `naming`, which says the layer."""
    if not all(torch.isfinite(t).all() for t in stats):
        raise ValueError("the statistics of its calibration inputs are not finite: the inputs hold Inf or NaN (a "
                         "16-bit model overflowing on the calibration text: calibrate it in bfloat16 or float32, "
                         "load_model(..., dtype=torch.float32)), or are so large that X^T X overflows float32")


def _block_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def forward_block(block: nn.Module, inputs: list, kwargs_list: list, watch: dict | None = None,
                  keep_outputs: bool = True):
    """Run ``block`` (in eval mode) on every calibration batch, with ``kwargs_list`` the keyword arguments of each
    (`capture_block_inputs`' ``kwargs[i]`` for block i); return (outputs or None, {name: InputStats}) for the
    linears in ``watch`` ({name: module}), whose inputs are reduced on the fly.

    With ``keep_outputs=False`` each batch stops as soon as every watched linear has seen its input
    (e.g. q/k/v need only the first norm of the block).
    """
    watch = watch or {}
    stats = {name: InputStats() for name in watch}
    seen = set()

    def hook(module, args, out, name):
        # what the weight multiplies: a HadamardInputLinear (rotated W4A4 down_proj) rotates its input first
        stats[name].add(hadamard_transform(args[0]) if getattr(module, "input_hadamard", False) else args[0])
        seen.add(name)
        if not keep_outputs and len(seen) == len(watch):
            raise _Stop

    handles = [m.register_forward_hook(lambda mod, args, out, name=name: hook(mod, args, out, name))
               for name, m in watch.items()]
    outputs, training = [], block.training
    block.eval()
    try:
        for x, kw in zip(inputs, kwargs_list, strict=True):
            seen.clear()
            try:
                y = _block_output(block(x, **kw))
            except _Stop:
                continue
            if keep_outputs:
                outputs.append(y)
    finally:
        block.train(training)
        for h in handles:
            h.remove()
    return (outputs if keep_outputs else None), stats


# Linears of a Llama/Qwen2/Qwen3/Mistral block, grouped by shared input, in the order those inputs are
# produced: q/k/v read the first norm's output, o_proj the attention output, gate/up the second
# norm's output, down_proj the gated product.
SHARED_INPUT_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def input_groups(names) -> list[list[str]]:
    """``names`` split into groups that see the same input, in forward order; unknown linears alone, last."""
    names = list(names)
    groups = [[n for n in g if n in names] for g in SHARED_INPUT_GROUPS]
    known = {n for g in groups for n in g}
    return [g for g in groups if g] + [[n] for n in names if n not in known]


def block_linears(block: nn.Module, prefix: str, skip) -> dict:
    """{relative name: nn.Linear} of one decoder block, without those ``skip(full_name)`` rejects."""
    return {name: m for name, m in block.named_modules()
            if isinstance(m, nn.Linear) and not skip(f"{prefix}.{name}")}


def skip_from_config(config):
    names = list(getattr(config, "modules_to_not_convert", None) or [])
    return lambda full: any(full == s or full.endswith("." + s) for s in names)


def quantize_blocks(model: nn.Module, config, calib, quantize_block, desc: str, *, batch_size: int, progress: bool,
                    onload) -> dict:
    """The walk GPTQ and AWQ share: ``{"model.layers.{i}.{name}": Int4Weight}`` of the decoder blocks' linears, as
    ``quantize_block`` makes them, block by block under a progress bar named ``desc``.

    ``calib`` is checked as quantize_model checks it (`check_calibration`), then run up to block 0
    (`capture_block_inputs`). ``quantize_block(prefix, block, linears, groups, inputs, kwargs, results)`` is given
    block i's name, the block (``onload(i, layer)``'s; None: `in_place`), its linears ({relative name: nn.Linear},
    less ``config.modules_to_not_convert``) grouped by shared input (`input_groups`), its calibration inputs and
    keyword arguments (`forward_block`'s), and the dict its Int4Weights go to by full name; it returns the next
    block's inputs, its own choice (GPTQ: the quantized block's outputs; AWQ: the float block's). They replace this
    block's before the next block is reached, so one block's activations are held at a time."""
    check_calibration(model, calib)  # as quantize_model's: windows that cannot calibrate, too few tokens
    skip = skip_from_config(config)
    inputs, kwargs = capture_block_inputs(model, calib, batch_size)
    results = {}
    for i, decoder_layer in enumerate(tqdm(decoder_layers(model), desc=desc, disable=not progress)):
        prefix = layer_prefix(i)
        with (onload or in_place)(i, decoder_layer) as (block, block_results):
            linears = block_linears(block, prefix, skip)
            inputs = quantize_block(prefix, block, linears, input_groups(linears), inputs, kwargs[i], block_results)
        results.update(block_results)
    return results
