"""The `nibble` command: generate, quantize, info, eval, report, qat, build-kernels, demo."""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

# torch, transformers and the rest of nibble are imported by the functions that use them: `nibble --help` and a
# command's checks then answer before their ~4 s of imports (tests/test_cli.py checks that this module stays light)
if TYPE_CHECKING:
    import torch

GENERATE_BATCH_SIZE = 8  # prompts `nibble generate` runs at once, where several are given
DEMO_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors."]


def _no_grad(function):
    """``@torch.no_grad()`` that imports torch when ``function`` runs, not when this module loads."""
    @functools.wraps(function)
    def without_grad(*args, **kwargs):
        import torch

        with torch.no_grad():
            return function(*args, **kwargs)
    return without_grad


def _device(name: str | None) -> str:
    from nibble.config import resolve_device

    return str(resolve_device(name))


def load(model: str | None, device: str, quantized: bool, dtype: torch.dtype | None = None):
    """A quantized checkpoint (nibble, AutoAWQ or GPTQ: ``quantized``, as `checkpoint_files.quantized_checkpoint` says), a
    local HF directory, a .gguf file, or None for the embedded SmolLM2."""
    from nibble.models.loading import load_model
    from nibble.models.serialization import load_quantized

    if quantized:
        return load_quantized(model, device=device, dtype=dtype)
    return load_model(model, dtype=dtype, device=device)


def check_tokenizer(args) -> None:
    """Refuse a quantized checkpoint saved without a tokenizer (save_quantized's default) before it loads, for a
    command that tokenizes: it failed on the first prompt with "'NoneType' object has no attribute ..."."""
    from nibble.models.loading import TOKENIZER_FILES, holds_tokenizer

    if args.quantized and not holds_tokenizer(Path(args.model)):
        raise ValueError(f"{args.model} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:4])}, ...), "
                         f"which nibble {args.command} needs: save it there with tokenizer.save_pretrained(DIR), or "
                         "pass it to save_quantized(model, DIR, tokenizer)")


def config_from_args(args, model):
    """The QuantConfig the quantization arguments ask for; ``model`` None leaves W4A16's default group
    at 128 (what `main` builds to check the arguments before any model loads)."""
    from nibble.config import QuantConfig
    from nibble.models.convert import default_group_size

    skip = [] if args.quantize_lm_head else ["lm_head"]
    common = dict(method=args.method, rotation="hadamard" if args.rotate else "none",
                  clip_search=args.clip_search or None, modules_to_not_convert=skip,
                  zero_point="float" if args.float_zero else "int")
    if args.quant == "w4a4":  # a group size other than None or -1, and --float-zero, refused by QuantConfig
        return QuantConfig(mode="w4a4", group_size=args.group_size, **common)
    # `is None`, not `or`: --group-size 0 must reach QuantConfig's refusal, not become 128
    cfg = QuantConfig(mode="w4a16", group_size=128 if args.group_size is None else args.group_size, **common)
    if args.group_size is None and model is not None:
        cfg = dataclasses.replace(cfg, group_size=default_group_size(model, cfg))
    return cfg


# The quantization options (`_add_model_args`) and their defaults: one away from its default was asked for.
QUANT_OPTIONS = {"quant": "w4a16", "group_size": None, "method": "rtn", "rotate": False, "clip_search": False,
                 "quantize_lm_head": False, "float_zero": False, "calib_samples": None, "calib_seq_len": None}


def _option(name: str) -> str:
    """An argument's command-line spelling: ``group_size`` -> ``--group-size``."""
    return "--" + name.replace("_", "-")


# `calibration_batches`' sizes that --calib-samples / --calib-seq-len set: the arguments, and the options as
# `options_named` says them in the library's refusals
CALIBRATION_ARGS = {"n_samples": "calib_samples", "seq_len": "calib_seq_len"}
CALIBRATION_OPTIONS = {name: _option(arg) for name, arg in CALIBRATION_ARGS.items()}


def check_least(args, minimums) -> None:
    """Refuse an option below its least value, ``minimums`` [(name, least), ...], before any model loads (an
    option left unset, None, passes)."""
    for name, least in minimums:
        value = getattr(args, name)
        if value is not None and value < least:
            raise ValueError(f"{_option(name)} must be >= {least}, got {value}")


def _flags(args, names) -> list[str]:
    """The options among the quantization ones ``names`` that ``args`` sets away from their defaults."""
    return [_option(n) for n in names if getattr(args, n) != QUANT_OPTIONS[n]]


def check_out(out: str, model: str | None, writes_model: bool = True) -> None:
    """Refuse an ``--out`` the command could not write, before a model loads (the work of a GPTQ calibration or a
    whole report was lost to a traceback at the end), and, for a command that writes a model there, the ``--model``
    folder itself (the 16-bit source was replaced)."""
    if not out.strip():  # an unset "$OUTDIR": it wrote into the current folder
        raise ValueError("--out is empty: give the folder to write to")
    path = Path(out)
    if path.is_symlink() and not path.exists():
        raise ValueError(f"--out {out} is a link to {os.readlink(path)}, which does not exist")
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out} is a file: give a folder")
    if writes_model:  # the --model folder above all (the 16-bit source was replaced); the library's own refusal
        from nibble.models.checkpoint_files import check_replaceable
        try:
            check_replaceable(path, model)
        except ValueError as e:  # it names the folder: said as the option's
            raise ValueError(f"--out {e}") from e
    nearest = path.absolute()  # the folder, or the nearest of its parents that exists (the command creates the rest)
    while not nearest.exists():
        nearest = nearest.parent
    if not nearest.is_dir():
        raise ValueError(f"--out {out} cannot be created: {nearest} is a file")
    try:  # a file made and removed there: os.access says yes to root, and to a read-only mount
        tempfile.TemporaryFile(dir=nearest).close()
    except OSError as e:
        # the folder exists: the error is the made file's (/proc refuses one with "No such file or directory"),
        # said as such, not as the folder's
        raise ValueError(f"--out {out} cannot be written: creating a file in {nearest} failed ({e.strerror or e}): "
                         "give a folder you can write to") from e


def check_seed(seed: int | None) -> None:
    """Refuse a --seed that torch's generators do not take, before any model loads, by the rule the library's seeds
    follow (`config.checked_seed`): the same seed is taken or refused everywhere. None (not given) passes."""
    from nibble.config import checked_seed

    if seed is not None:
        checked_seed("--seed", seed)


@contextlib.contextmanager
def options_named(**options: str):
    """A library's refusal raised inside (ValueError, or FloatingPointError: a training run that diverged), a
    KeyboardInterrupt that says how to go on (`QatInterrupted`), and a warning shown inside, said in the command's
    terms: each parameter name among ``options`` (``lr``, ``n_samples=4``, a settings key ``'rank'``; a flag's
    ``resume=True``) as the option that set it (``--lr``, ``--calib-samples=4``, ``--rank``; ``--resume``). The
    library names its parameters, for its Python callers; a command renames them where it calls it, rather than
    checking each value again in words of its own. The exception keeps its type and traceback (NIBBLE_TRACEBACK=1);
    a warning is renamed as it is shown, not as it is raised (a filter sees the library's)."""
    import re

    def renamed(text: str) -> str:
        for name, option in options.items():  # a whole name only: not the "lr" of "quant_lr", of "--lr" or of a path
            text = re.sub(rf"'{name}'|(?<![\w/-]){name}(?![\w/-])", option, text)
        return text

    shown = warnings.formatwarning
    warnings.formatwarning = lambda message, *args, **kwargs: shown(renamed(str(message)), *args, **kwargs)
    try:
        yield
    except (ValueError, FloatingPointError, KeyboardInterrupt) as e:
        said = renamed(str(e))
        if said != str(e):  # else left as it is (a UnicodeDecodeError's message is made from its fields)
            e.args = (said,)
        raise
    finally:
        warnings.formatwarning = shown


def check_quant_args(args) -> None:
    """Refuse quantization options that would be silently ignored, before any model loads: any of them with a
    quantized --model (it is used as it is), with --quant none, and the options of one mode or method given
    to another; then the combinations QuantConfig refuses."""
    if args.quantized:
        given = _flags(args, QUANT_OPTIONS)
        if given:
            used = ("its weights are written as they are (in --format's layout)" if args.command == "quantize"
                    else "it runs as it is")
            raise ValueError(f"{args.model} is already quantized: {used}, so {', '.join(given)} "
                             f"{'does' if len(given) == 1 else 'do'} not apply; drop "
                             f"{'it' if len(given) == 1 else 'them'}, or give the 16-bit model to quantize it that way")
        return
    if args.quant == "none":
        given = _flags(args, [n for n in QUANT_OPTIONS if n != "quant"])
        if given:
            raise ValueError(f"{', '.join(given)} {'sets' if len(given) == 1 else 'set'} how to quantize, and --quant "
                             f"none runs the model unquantized: drop {'it' if len(given) == 1 else 'them'}, or give "
                             "--quant w4a16 or w4a4")
        return
    if args.clip_search and args.method != "rtn" and not args.quantize_lm_head:
        raise ValueError(f"--clip-search is RTN's clipping search, and --method {args.method} runs its own calibrated "
                         "one: drop it (it applies only to a head quantized by RTN, with --quantize-lm-head)")
    if args.rotate and args.quant != "w4a4":  # QuantConfig takes it, for a W4A16 model that keeps its down_projs
        raise ValueError("--rotate is for --quant w4a4: the rotation gives each down_proj an online Hadamard, which "
                         "W4A16 layers do not run (in Python, quantize_model keeps them in 16 bits for W4A16 with "
                         "modules_to_not_convert=['lm_head', 'down_proj'])")
    if args.quant == "w4a4":  # what QuantConfig refuses, said as the options (it names its own fields)
        given = _flags(args, ("group_size", "float_zero"))
        if given:
            one = len(given) == 1
            raise ValueError(f"{' and '.join(given)} {'shapes' if one else 'shape'} W4A16's groups, and --quant w4a4 "
                             "quantizes each output channel whole and symmetric (its integer GEMM applies one weight "
                             f"scale a channel, after the int32 sum): drop {'it' if one else 'them'}")
        if args.method == "awq":
            raise ValueError("--method awq is for --quant w4a16: AWQ's per-channel scales would move into the "
                             "activations that W4A4 quantizes per token; give --method rtn or gptq (nibble qat "
                             "recovers more)")
    check_calibration_sizes(args, args.method != "rtn", "--method gptq / awq", "RTN")
    with options_named(group_size="--group-size"):
        config_from_args(args, None)  # a value QuantConfig refuses (--group-size 0)


def calibration_sizes(args) -> dict:
    """`calibration_batches`' ``n_samples`` / ``seq_len`` that --calib-samples / --calib-seq-len give."""
    return {k: getattr(args, n) for k, n in CALIBRATION_ARGS.items() if getattr(args, n) is not None}


def check_calibration_sizes(args, calibrated: bool, calibrating: str, other: str) -> None:
    """Refuse --calib-samples / --calib-seq-len below their minimum, given where nothing is calibrated
    (``calibrated`` False: ``calibrating`` names the options that would calibrate, ``other`` the choice made), or
    windows longer than the --model's context, before it loads."""
    given = [_option(n) for n in ("calib_samples", "calib_seq_len") if getattr(args, n) is not None]
    if given and not calibrated:
        one = len(given) == 1
        raise ValueError(f"{', '.join(given)} {'sizes' if one else 'size'} the calibration of {calibrating}; "
                         f"{other} calibrates nothing: drop {'it' if one else 'them'}, or give {calibrating}")
    check_least(args, (("calib_samples", 1), ("calib_seq_len", 2)))
    if args.calib_seq_len is not None:  # quantize_model refused it after the model loaded and the text was tokenized
        from nibble.models.architecture import check_calibration_window
        from nibble.models.loading import model_context
        check_calibration_window(args.calib_seq_len, model_context(args.model), "--calib-seq-len")


def load_for_command(args, device: str):
    """(model, tokenizer) as a command runs them: a nibble checkpoint as saved, a float model as it is with
    ``--quant none``, else the float model quantized as the arguments say (GPTQ / AWQ calibrated on the C4
    excerpt). A model quantized for a GPU is read into host memory and quantized onto the GPU one decoder
    layer at a time (`quantize_model`'s ``device``): the GPU never holds its 16-bit weights, so a model that
    fits the GPU only in 4 bits runs."""
    import torch

    from nibble.config import default_dtype
    from nibble.models.convert import quantize_model
    from nibble.quantize.calibration import calibration_for

    if args.quant == "none" or args.quantized:
        return load(args.model, device, args.quantized)
    from nibble.eval.data import require_data
    from nibble.quantize.calibration import calibration_files
    require_data(calibration_files(args.method))  # before the model loads
    model, tok = load(args.model, "cpu", quantized=False, dtype=default_dtype(torch.device(device)))
    # a group size the model's widths refuse, a calibration text too short for the windows asked
    with options_named(group_size="--group-size", **CALIBRATION_OPTIONS):
        cfg = config_from_args(args, model)
        calibration = calibration_for(cfg, tok, model, **calibration_sizes(args))
        return quantize_model(model, cfg, calibration=calibration, device=device), tok


def check_fits_context(max_new_tokens: int, context: int | None, prompt_tokens: int | None = None) -> None:
    """Refuse ``max_new_tokens`` after a prompt of ``prompt_tokens`` (the longest of several; None: not tokenized
    yet, so one at least) that the model's ``context`` (config.max_position_embeddings; None: unknown, nothing
    refused) cannot hold, prompt and new tokens together, as `Engine.generate` refuses a request past its cache (the
    context, by default): positions past it are beyond what the model learned, and the engine sizes its cache and
    rotary table for the whole request up front (max_new_tokens=10**9 was a 32 GB allocation, after a minute)."""
    if context is None:
        return
    if prompt_tokens is None:
        if max_new_tokens >= context:
            raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's context "
                             f"({context} tokens, the prompt's and the new ones together): give at most "
                             f"{context - 1}, less the prompt's tokens")
    elif prompt_tokens >= context:
        raise ValueError(f"a prompt of {prompt_tokens} tokens fills the model's context ({context} tokens) before any "
                         "new one: give a shorter prompt")
    elif prompt_tokens + max_new_tokens > context:
        raise ValueError(f"a prompt of {prompt_tokens} tokens and max_new_tokens={max_new_tokens} exceed the model's "
                         f"context ({context} tokens, the prompt's and the new ones together): give at most "
                         f"{context - prompt_tokens}, or a shorter prompt")


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int, chat: bool, engine: bool = True,
                  sampling=None, streamer=None) -> str:
    """The continuation of ``prompt``, decoded: greedy, or sampled as ``sampling`` (an
    `engine.Sampling`) says. Run by nibble's engine (a static KV cache; on a GPU, CUDA graphs: the
    decode speeds nibble reports) unless ``engine`` is False or the model is one the engine cannot run
    (then by transformers' ``generate``, said on stderr); greedy, both give the same tokens up to
    near-ties (sampled, the same distribution, not the same draws); both stop at the model's
    end-of-sequence token. ``streamer`` (e.g. transformers' ``TextStreamer``) is given the prompt,
    then the new tokens as they come, then ``end()``, from either way as transformers' generate does.
    A prompt and ``max_new_tokens`` longer than the model's context together are refused (`check_fits_context`)."""
    import torch

    from nibble.eval.perplexity import context_length

    ids = torch.tensor([_prompt_ids(tokenizer, prompt, chat)], device=next(model.parameters()).device)
    check_fits_context(max_new_tokens, context_length(model), ids.shape[1])
    eos = _stop_ids(model, tokenizer)
    new = _engine_tokens(model, ids, max_new_tokens, eos or None, sampling, streamer) if engine else None
    if new is None:
        new = _transformers_tokens(model, tokenizer, ids.tolist(), max_new_tokens, sampling, streamer)[0]
    return _decode_until_stop(tokenizer, new, eos)


@_no_grad
def _transformers_tokens(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, sampling=None,
                         streamer=None) -> torch.Tensor:
    """transformers' ``generate`` on a batch of prompts of any lengths, padded on the left as it wants them (an
    attention mask keeps the pads out, and transformers counts each row's positions from its first real token);
    the new tokens, [batch, <= max_new_tokens]."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    device = next(model.parameters()).device
    if sampling is not None:
        sampling.warn_if_filters_unused()  # as the engine does
    # top_k=0: no top-k filter (transformers' default would be 50), as the engine's None
    draws = {} if sampling is None or sampling.greedy else dict(
        do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p)
    watch = _FiniteLogitsWatch(width, _stop_ids(model, tokenizer), next(model.parameters()).dtype, device)
    try:
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             **({"do_sample": False} | draws), pad_token_id=pad, streamer=streamer,
                             logits_processor=[watch])
    except FloatingPointError:  # the watch's: the text streamed before it ends its line, as the engine's path does
        if streamer is not None:
            streamer.end()
        raise
    return out[:, width:].cpu()


class _FiniteLogitsWatch:
    """A logits processor for transformers' ``generate`` (after its own processors, before its temperature and
    filters) that raises the engine's error (`engine.nonfinite_logits_error`) at the first step whose scores held a
    NaN or +inf for a sequence not yet stopped, before a token is picked from them: greedy, generate took the
    NaN's index without a word; sampled, it failed on "probability tensor contains either inf, nan or element < 0".
    A -inf is what its own processors write to rule a token out. One read of the device a step, as generate's own
    stop check makes."""

    def __init__(self, width: int, stop_ids: set[int], dtype: torch.dtype, device):
        import torch

        self.width, self.dtype = width, dtype
        # on generate's device once, not copied there at every step
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch

        from nibble.eval.engine import nonfinite_logits_error

        new = input_ids[:, self.width:]
        stopped = torch.isin(new, self.stop_ids).any(-1)
        broken = (scores.isnan() | scores.isposinf()).any(-1) & ~stopped
        bad = broken.nonzero().flatten().tolist()
        if bad:
            raise nonfinite_logits_error(new.shape[1], bad[0], len(bad) - 1, len(scores), self.dtype)
        return scores


def generate_texts(model, tokenizer, prompts: list[str], max_new_tokens: int, chat: bool, engine: bool = True,
                   sampling=None, batch_size: int = GENERATE_BATCH_SIZE) -> Iterator[str]:
    """The continuations of several prompts, as `generate_text` gives each, ``batch_size`` at a time, yielded in the
    prompts' order as each batch completes (`nibble generate` prints a batch's answers while the next one runs;
    ``list(...)`` takes them all). nibble's engine runs each batch as one ragged batch (every prompt at its own
    length, no padding that the model sees); without it (``engine`` False, or a model it cannot run) transformers'
    ``generate`` runs the batch padded on the left. Greedy, each continuation is the one the prompt gets alone, up to
    near-ties. A prompt and ``max_new_tokens`` longer than the model's context together are refused before the first
    batch runs (`check_fits_context`)."""
    from nibble.eval.perplexity import context_length

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ids = [_prompt_ids(tokenizer, p, chat) for p in prompts]  # a chat template that fails: said here, not at a batch
    check_fits_context(max_new_tokens, context_length(model), max(map(len, ids), default=None))
    return _batch_texts(model, tokenizer, ids, max_new_tokens, engine, sampling, batch_size)


def _batch_texts(model, tokenizer, ids: list[list[int]], max_new_tokens: int, engine: bool, sampling,
                 batch_size: int) -> Iterator[str]:
    """`generate_texts`' continuations of the prompts ``ids`` (their token ids), yielded as each batch completes."""
    import torch

    eos = _stop_ids(model, tokenizer)
    runner = None
    if engine and ids:
        runner = _open_engine(model, min(batch_size, len(ids)), max(map(len, ids)) + max_new_tokens)
    device = next(model.parameters()).device
    try:
        for start in range(0, len(ids), batch_size):
            batch = ids[start:start + batch_size]
            if runner is None:
                new = _transformers_tokens(model, tokenizer, batch, max_new_tokens, sampling)
            else:
                new = runner.generate([torch.tensor(t, device=device) for t in batch], max_new_tokens,
                                      stop_tokens=eos or None, **_sampling_kwargs(sampling)).cpu()
            yield from (_decode_until_stop(tokenizer, row, eos) for row in new)
    finally:  # also where the caller stops reading early
        if runner is not None:
            runner.close()


def _open_engine(model, max_batch: int, max_seq_len: int):
    """nibble's engine for this model, or None (said on stderr) where it cannot run it."""
    from nibble.eval.engine import Engine

    try:
        return Engine(model, max_batch=max_batch, max_seq_len=max_seq_len)
    except ValueError as e:
        print(f"nibble: {e}; generating with transformers' generate instead", file=sys.stderr)
        return None


def _sampling_kwargs(sampling) -> dict:
    """`Engine.generate` / `stream`'s keyword arguments for ``sampling`` (None: greedy)."""
    return {} if sampling is None else dict(temperature=sampling.temperature, top_k=sampling.top_k,
                                            top_p=sampling.top_p)


def _prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    """The prompt's token ids, in the chat template when ``chat`` and the tokenizer has one. A prompt of no token (an
    empty one, where the tokenizer adds no BOS) is refused: the engine said it in tensor terms, transformers' generate
    with a traceback from a reshape."""
    text, special = prompt, True
    if chat and tokenizer.chat_template:
        from jinja2 import TemplateError
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
        except TemplateError as e:  # a template that does not compile, or raises (a traceback, nibble's error type)
            raise ValueError(f"the model's chat template fails ({e}): fix it, or prompt without it with "
                             "--no-chat") from e
        special = False  # the template writes its own BOS (Llama's, Mistral's): the tokenizer's would be a second one
    from nibble.eval.perplexity import encode  # quiet: transformers' "longer than the maximum" line came before
    ids = encode(tokenizer, text, special)       # nibble's own refusal of a prompt that fills the context
    if not ids:
        raise ValueError(f"the prompt {prompt!r} is no token to the tokenizer, and generation continues a prompt: "
                         "give it some text")
    return ids


def _stop_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    return {e for e in (eos if isinstance(eos, list) else [eos, tokenizer.eos_token_id]) if e is not None}


def _decode_until_stop(tokenizer, new: torch.Tensor, stop_ids) -> str:
    ends = [i for i, t in enumerate(new.tolist()) if t in stop_ids]
    return tokenizer.decode(new[:ends[0]] if ends else new, skip_special_tokens=True).strip()


def _engine_tokens(model, ids: torch.Tensor, max_new_tokens: int, stop_tokens, sampling=None,
                   streamer=None) -> torch.Tensor | None:
    """Up to ``max_new_tokens`` tokens after ``ids`` [1, T] from nibble's engine, greedy or as ``sampling``
    says, up to the first of ``stop_tokens``, handed to ``streamer`` as they come (see `generate_text`);
    or None where the engine cannot run this model."""
    import torch

    engine = _open_engine(model, 1, ids.shape[1] + max_new_tokens)
    if engine is None:
        return None
    chunks = []
    try:
        if streamer is not None:
            streamer.put(ids.cpu())
        for chunk in engine.stream(ids, max_new_tokens, stop_tokens=stop_tokens, **_sampling_kwargs(sampling)):
            chunk = chunk[0].cpu()
            ends = [i for i, t in enumerate(chunk.tolist()) if t in (stop_tokens or ())]
            chunks.append(chunk[:ends[0] + 1] if ends else chunk)
            if streamer is not None:
                streamer.put(chunks[-1])
            if ends:
                break
        if streamer is not None:
            streamer.end()
        return torch.cat(chunks)
    except FloatingPointError:  # logits that were not finite (`Engine.generate`), said by `main` as the command's error
        if streamer is not None and chunks:  # the text of the tokens before them, streamed: its line ends first
            streamer.end()
        raise
    finally:
        engine.close()


# the parameters of generation said as the options that set them: the refusals of a prompt too long for
# --max-new-tokens, and the warning of top_k / top_p given to greedy decoding
GENERATE_OPTIONS = dict(max_new_tokens="--max-new-tokens", temperature="--temperature", top_k="--top-k",
                        top_p="--top-p")


def cmd_generate(args):
    import torch

    from nibble.eval.engine import MIN_TEMPERATURE, Sampling

    # the settings are checked before the model loads (a ValueError is said by `main`)
    if args.top_k is not None and args.top_k < 0:  # Sampling's message names None, which no command line can write
        raise ValueError(f"--top-k must be >= 1, or 0 for every token; got {args.top_k}")
    with options_named(**GENERATE_OPTIONS):  # "top_p must be ...": said as the option
        sampling = Sampling(args.temperature, args.top_k or None, args.top_p)  # --top-k 0: off, as in transformers
    check_max_new_tokens(args)
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            # "utf-8-sig": the BOM that Windows editors write went into the first prompt, an invisible first token
            lines = Path(args.prompts_file).read_text(encoding="utf-8-sig").splitlines()
        except OSError as e:
            raise ValueError(f"cannot read --prompts-file: {e}") from None
        except UnicodeDecodeError as e:  # the codec's message named neither the file nor the option
            raise ValueError(f"--prompts-file {args.prompts_file} is not UTF-8 text ({e.reason} at byte {e.start}): "
                             "save it as UTF-8") from None
        prompts += [line for line in lines if line.strip()]
        if not prompts:
            raise ValueError(f"--prompts-file {args.prompts_file} holds no prompt (one a line; blank lines are "
                             "skipped)")
    if not prompts:
        raise ValueError("give a prompt, several, or --prompts-file (one prompt a line)")
    # an unset "$PROMPT": refused before the model loads, as --prompts-file skips its blank lines (with the chat
    # template it was answered as a message, without it a traceback)
    blank = [i for i, prompt in enumerate(args.prompt, 1) if not prompt.strip()]
    if blank:
        which = f"prompt {blank[0]} of the {len(args.prompt)} given" if len(args.prompt) > 1 else "the prompt"
        raise ValueError(f"{which} is {'blank' if args.prompt[blank[0] - 1] else 'empty'}: give its text (an unset "
                         "shell variable?), or drop it")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.stats and len(prompts) > 1:
        raise ValueError("--stats times one prompt; give a single one")
    check_seed(args.seed)  # one out of range is refused, not warned about as ignored below
    # options this run ignores, said as --top-k / --top-p without a temperature are (`Sampling.warn_if_filters_unused`)
    if args.batch_size is not None and len(prompts) == 1:
        warnings.warn("--batch-size sets how many of several prompts run at once: with one prompt it is ignored")
    if args.seed is not None and sampling.greedy:
        to_sample = ("give a --temperature > 0 to sample" if sampling.temperature < MIN_TEMPERATURE else
                     "give --top-k > 1 (or 0, off) to sample")  # --top-k 1 with a temperature
        warnings.warn("--seed repeats sampled tokens only: greedy decoding (temperature 0, or --top-k 1) draws none, "
                      f"so it is ignored; {to_sample}")
    check_tokenizer(args)
    model, tok = load_for_command(args, _device(args.device))
    if args.seed is not None:
        torch.manual_seed(args.seed)
    if len(prompts) > 1:
        with options_named(**GENERATE_OPTIONS):  # a prompt too long for it: said before any batch
            texts = generate_texts(model, tok, prompts, args.max_new_tokens, not args.no_chat,
                                   engine=not args.hf_generate, sampling=sampling,
                                   batch_size=args.batch_size or GENERATE_BATCH_SIZE)
        # each batch's answers as it completes (flushed: a pipe holds them back otherwise), while the next one runs;
        # strict: the texts are read to their end, which closes the engine
        for i, (prompt, text) in enumerate(zip(prompts, texts, strict=True), 1):
            print(f"[{i}] {prompt}\n{text}\n", flush=True)
        return
    from transformers import TextStreamer

    # the text appears word by word as the tokens come (transformers' streamer, on either way of generating)
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    if args.stats:
        streamer = TimedStreamer(streamer)
    with options_named(**GENERATE_OPTIONS):  # a prompt too long for it: said before the first token
        generate_text(model, tok, prompts[0], args.max_new_tokens, not args.no_chat, engine=not args.hf_generate,
                      sampling=sampling, streamer=streamer)
    if args.stats:
        print(f"nibble: {streamer.summary()}", file=sys.stderr)


def check_max_new_tokens(args) -> None:
    """--max-new-tokens at least 1 and, with a prompt of one token at least, within the model's context (read from
    its config), before the model loads: `generate_text(s)` refuse it against the prompts themselves once they are
    tokenized (`check_fits_context`)."""
    from nibble.models.loading import model_context

    check_least(args, (("max_new_tokens", 1),))
    with options_named(max_new_tokens="--max-new-tokens"):
        check_fits_context(args.max_new_tokens, model_context(args.model))


class TimedStreamer:
    """A streamer (transformers' ``put`` / ``end``) that passes everything on to ``inner`` and times it:
    the prompt's put starts the clock, each later put is new tokens. nibble's engine hands them over 16 at
    a time on a GPU (transformers' generate one at a time), and its first ones include the prefill and
    the capture of the step's CUDA graphs, so the rate is also given from the first hand-over on."""

    def __init__(self, inner):
        self.inner, self.prompt_tokens, self.start, self.puts = inner, None, None, []

    def put(self, value) -> None:
        now = time.perf_counter()
        if self.start is None:
            self.start, self.prompt_tokens = now, value.numel()
        else:
            self.puts.append((now, value.numel()))
        self.inner.put(value)

    def end(self) -> None:
        self.inner.end()

    def summary(self) -> str:
        new = sum(n for _, n in self.puts)
        if not new:
            return f"{self.prompt_tokens} prompt tokens, no new token"
        elapsed = self.puts[-1][0] - self.start
        line = f"{self.prompt_tokens} prompt tokens, {new} new in {elapsed:.2f} s ({_rate(new / elapsed)} tokens/s)"
        later = new - self.puts[0][1]
        if later:
            steady = later / (self.puts[-1][0] - self.puts[0][0])
            line += (f"; {_rate(steady)} tokens/s after the first {self.puts[0][1]}, which include the prefill (and, "
                     "on a GPU, the engine's graph capture)")
        return line


def _rate(per_second: float) -> str:
    """One decimal from 1 a second up, two significant digits below: 8 tokens in 239 s (a loaded CPU) printed 0.0."""
    return f"{per_second:.1f}" if per_second >= 1 else f"{per_second:.2g}"


def cmd_quantize(args):
    from nibble.models.convert import TIED_HEAD, weight_bytes
    from nibble.models.serialization import save_quantized

    check_export(args)
    model, tok = load_for_command(args, _device(args.device))
    out = save_quantized(model, args.out, tok, format=args.format)
    wb = weight_bytes(model)
    # a head tied to the embedding was no bytes of its own in 16 bits: its quantized copy is added to the model
    tied = (", the tied lm_head as 0: its table stays the embedding's, and its quantized copy is added"
            if model.config.quantization_config.get(TIED_HEAD) else "")
    print(f"saved {out}: quantized linears {wb['quantized_bytes'] / 2**20:.1f} MiB "
          f"({wb['ratio']:.3f}x of {wb['bf16_bytes'] / 2**20:.1f} MiB in 16 bits{tied})")


def check_export(args) -> None:
    """Refuse a --format awq / gptq that cannot hold the model `nibble quantize` would write, before it loads: an
    AutoAWQ / GPTQ checkpoint holds W4A16 weights with integer zero points and a 16-bit lm_head. Said as the options
    that make it otherwise: those given, or those a quantized --model of nibble's was made with, as its config says
    (the export's own refusal came once the model had loaded, in QuantConfig's terms: "modules_to_not_convert")."""
    if args.format == "nibble":
        return
    if args.quantized:
        from nibble.config import QUANT_METHOD, QuantConfig
        from nibble.models.loading import CONFIG, read_json_object

        qc = read_json_object(Path(args.model) / CONFIG).get("quantization_config")
        if not (isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD):
            return  # an AutoAWQ / GPTQ checkpoint: it is such weights
        cfg = QuantConfig.from_dict(qc)
        mode, float_zero, head = cfg.mode, cfg.zero_point == "float", "lm_head" not in cfg.modules_to_not_convert
    else:
        mode, float_zero, head = args.quant, args.float_zero, args.quantize_lm_head
    made = [(what, option) for what, option, holds in (
        ("W4A4 weights", "--quant w4a4", mode == "w4a4"), ("float zero points", "--float-zero", float_zero),
        ("a 4-bit lm_head", "--quantize-lm-head", head)) if holds]
    if not made:
        return
    options = " / ".join(option for _, option in made)
    if args.quantized:
        raise ValueError(f"--format {args.format} holds W4A16 weights with integer zero points and a 16-bit lm_head, "
                         f"and {args.model} holds {' and '.join(what for what, _ in made)} ({options}): re-quantize "
                         f"its 16-bit model without {options}, or write --format nibble")
    raise ValueError(f"--format {args.format} holds W4A16 weights with integer zero points and a 16-bit lm_head: "
                     f"drop {options}, or write --format nibble")


def cmd_info(args):
    from nibble.eval.memory import weight_memory
    from nibble.models.convert import quantized_linears, weight_bytes
    from nibble.models.serialization import quantized_structure

    # the model as load_quantized builds it on the CPU, read from the files' headers, not their data: a moment and
    # little memory for a checkpoint of any size (the load it once ran took minutes and all of its weights in
    # float32); what it prints is of the weights alone, so no tokenizer is read
    model = quantized_structure(args.dir)
    qc = model.config.quantization_config
    wb = weight_bytes(model)
    total = weight_memory(model)["total_bytes"]  # a tied lm_head counted once, as the file holds it
    # the state as loaded here (its 16-bit tensors in `dtype`) can differ from the files: both are said
    files = sum(p.stat().st_size for p in Path(args.dir).expanduser().glob("*.safetensors"))
    # the files' own format first: an AutoAWQ / GPTQ checkpoint's config is held as nibble's, its own under
    # "imported_from" (a reader of the top saw "quant_method": "nibble")
    print(json.dumps({"checkpoint_format": qc.get("imported_from", {}).get("quant_method", "nibble"),
                      "quantization_config": qc, "architecture": model.config.model_type,
                      "quantized_linears": len(quantized_linears(model)),
                      "quantized_linear_bytes": wb["quantized_bytes"], "same_linears_in_16bit_bytes": wb["bf16_bytes"],
                      "ratio": round(wb["ratio"], 4), "bytes_saved": wb["bf16_bytes"] - wb["quantized_bytes"],
                      "total_state_bytes": total, "dtype": str(model.dtype).removeprefix("torch."),
                      "weight_file_bytes": files}, indent=2))


# `nibble eval`'s options of one `what` only (--batch-size is both's)
EVAL_OPTIONS = {"ppl": ("seq_len", "max_tokens"), "tasks": ("tasks", "limit")}


def cmd_eval(args):
    # checked before the model loads: an option of the other `what` would be silently ignored, and a count too
    # small would fail only once the model is loaded (or print NaN)
    other = "tasks" if args.what == "ppl" else "ppl"
    wrong = [_option(n) for n in EVAL_OPTIONS[other] if getattr(args, n) is not None]
    if wrong:
        raise ValueError(f"{' and '.join(wrong)} belong{'s' * (len(wrong) == 1)} to `nibble eval {other}`; `eval "
                         f"{args.what}` takes {', '.join(map(_option, EVAL_OPTIONS[args.what]))} and --batch-size: "
                         f"drop {' and '.join(wrong)}")
    # a window of 2 tokens predicts one: the shortest stream or window that scores anything
    check_least(args, (("seq_len", 2), ("max_tokens", 2), ("limit", 1), ("batch_size", 1)))
    from nibble.bench.timing import env_meta, json_text
    from nibble.eval.data import require_data
    from nibble.eval.perplexity import WIKITEXT2_TEST, check_model_window
    check_model_window(args.model, args.seq_len, args.max_tokens, ("--seq-len", "--max-tokens"))
    check_tokenizer(args)
    from nibble.eval import ALL_TASKS
    from nibble.eval.tasks import evaluate_tasks, task_files

    tasks = args.tasks or ALL_TASKS
    require_data([WIKITEXT2_TEST] if args.what == "ppl" else task_files(tasks))

    model, tok = load_for_command(args, _device(args.device))
    if args.what == "ppl":
        from nibble.eval.perplexity import wikitext2_perplexity
        # its warning of a window past the context, its refusal of a batch whose logits exceed the memory
        with options_named(seq_len="--seq-len", batch_size="--batch-size"):
            result = wikitext2_perplexity(model, tok, seq_len=args.seq_len, max_tokens=args.max_tokens,
                                          batch_size=args.batch_size)
    else:
        with options_named(batch_size="--batch-size"):  # its refusal of a batch whose logits exceed the memory
            result = evaluate_tasks(model, tok, tasks, limit=args.limit, batch_size=args.batch_size)
    # what was measured, beside the numbers (--quant defaults to w4a16: a bare number did not say which model it was)
    weight = next(model.parameters())
    setup = env_meta(model=args.model or "default (SmolLM2-135M-Instruct)",
                     quantization=getattr(model.config, "quantization_config", None) or "none (16-bit)",
                     dtype=str(weight.dtype).removeprefix("torch."), device=str(weight.device))
    print(json_text({**result, "setup": setup}, indent=2, default=str))  # a NaN perplexity as null
    check_scored(result, setup["dtype"])


def check_scored(result: dict, dtype: str) -> None:
    """Say what a null in `nibble eval`'s JSON means, after it is printed: an infinite perplexity (a mean NLL past the
    range of exp) as a warning, NaN scores (the model's logits were not finite) as the command's error, status 1. Each
    was a bare null, status 0 (a standard error is NaN for one document, lm-eval's N/A: not said)."""
    import math

    if math.isinf(result.get("ppl", 0.0)) and math.isfinite(result["nll"]):
        warnings.warn(f"the perplexity is infinite (null in the JSON): its mean NLL, {result['nll']:.4g} a token, is "
                      "past the range of exp; the model's predictions are far off")
    scores = {"ppl": result.get("ppl")} if "ppl" in result else {
        f"{task} {metric}": value for task, metrics in result.items() for metric, value in metrics.items()
        if metric in ("acc", "acc_norm")}
    nan = [name for name, value in scores.items() if math.isnan(value)]
    if nan:
        raise ValueError(f"{', '.join(nan)} {'is' if len(nan) == 1 else 'are'} NaN (null in the JSON): the model's "
                         f"logits were not finite: its weights hold NaN or Inf, or its activations overflowed {dtype}")


def cmd_build_kernels(args):
    import torch

    from nibble.kernels.cuda_build import device_arch, prebuild

    check_least(args, (("jobs", 1),))  # said as the option, before prebuild's own check
    arch = args.arch
    if arch is None:
        if not torch.cuda.is_available():
            raise ValueError("no CUDA GPU visible to read its architecture from; pass --arch "
                             "(90 for H100/H200, 80 for A100, 89 for L4/L40, ...)")
        arch = device_arch(torch.device("cuda"))
    with options_named(arch="--arch"):  # a refused arch said as the option ("arch must be ...", its parameter)
        paths = prebuild(arch, jobs=args.jobs)  # a CudaBuildError or a refused arch: main says it in one line
    for name, path in paths.items():
        print(f"{name}: {path}")


@_no_grad
def cmd_demo(args):
    """SmolLM2 -> W4A16 g64 -> side-by-side generations, bytes, logits cosine, perplexity on a slice."""
    import torch

    from nibble.config import QuantConfig
    from nibble.eval.perplexity import wikitext2_perplexity
    from nibble.models.convert import default_group_size, quantize_model, weight_bytes

    if args.quantized:
        raise ValueError(f"{args.model} is already quantized, and the demo compares a 16-bit model with its W4A16 "
                         "copy: give it a 16-bit model (an HF dir or a .gguf), or run this one with `nibble "
                         "generate --model` / `nibble eval ppl --model`")
    check_least(args, (("ppl_tokens", 2),))
    check_max_new_tokens(args)
    from nibble.eval.data import require_data
    from nibble.eval.perplexity import WIKITEXT2_TEST
    require_data([WIKITEXT2_TEST])  # its last step, after minutes of work on a CPU
    t0 = time.time()
    device = _device(args.device)
    model, tok = load(args.model, device, quantized=False)
    print(f"loaded {model.config.model_type} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params) "
          f"in {time.time() - t0:.1f}s")
    qmodel = copy.deepcopy(model)
    # A float minimum per group (llama.cpp Q4_1 style) measured best on SmolLM2: 1.29x the 16-bit
    # perplexity on this slice against 1.40x with integer zero points; the MSE clipping search made
    # both worse (1.39x / 1.43x), so it stays off here.
    cfg = QuantConfig(mode="w4a16", group_size=default_group_size(model), zero_point="float")
    t1 = time.time()
    quantize_model(qmodel, cfg)
    print(f"quantized W4A16 g{cfg.group_size} (RTN, asymmetric, float minimum) in {time.time() - t1:.1f}s\n")
    for prompt in DEMO_PROMPTS:
        print(f"prompt: {prompt}")
        for label, m in (("16-bit", model), ("W4A16", qmodel)):
            with options_named(max_new_tokens="--max-new-tokens"):  # a prompt too long for it
                print(f"  {label:>6}: {generate_text(m, tok, prompt, args.max_new_tokens, True)!r}")
    wb = weight_bytes(qmodel)
    ids = tok("\n".join(DEMO_PROMPTS), return_tensors="pt").input_ids.to(device)
    cos = torch.nn.functional.cosine_similarity(model(ids).logits.float().flatten(),
                                                qmodel(ids).logits.float().flatten(), dim=0).item()
    # a minute on a CPU: said as it starts (one window, the default, is one forward pass each, which shows no bar)
    print(f"\nscoring the 16-bit and the W4A16 model on the first {args.ppl_tokens} WikiText-2 test tokens ...",
          flush=True)
    scored16 = wikitext2_perplexity(model, tok, max_tokens=args.ppl_tokens)
    ppl16, ppl4 = scored16["ppl"], wikitext2_perplexity(qmodel, tok, max_tokens=args.ppl_tokens)["ppl"]
    read = scored16["windows"] * scored16["seq_len"]  # fewer than asked past the split's end or a ragged tail
    print(f"\nweights of the quantized linears: {wb['bf16_bytes'] / 2**20:.1f} MiB (16-bit) -> "
          f"{wb['quantized_bytes'] / 2**20:.1f} MiB (W4A16 g{cfg.group_size}, scales+zeros counted) = {wb['ratio']:.3f}x")
    print(f"logits cosine similarity (16-bit vs W4A16): {cos:.5f}")
    print(f"WikiText-2 test perplexity, first {read} tokens ({scored16['tokens']} predicted): 16-bit {ppl16:.3f}, "
          f"W4A16 {ppl4:.3f} ({ppl4 / ppl16:.3f}x)")
    if args.model is None:  # the default model, a Q4_1 GGUF: of another --model this would be untrue
        print("note: SmolLM2's 16-bit weights are themselves dequantized Q4_1, so this is re-quantization loss.")
    print(f"demo finished in {time.time() - t0:.0f}s")


def _add_model_args(p, quant=True, runs_16_bit=True):
    """The model options; ``quant``: and how to quantize it, ``runs_16_bit``: --quant none among them."""
    quantized = "a quantized dir (nibble, AutoAWQ or GPTQ: used as it is, not quantized again), " if quant else ""
    p.add_argument("--model", default=None, help=f"{quantized}an HF dir or a .gguf (default: embedded SmolLM2-135M)")
    p.set_defaults(quantized=None)  # whether --model is a quantized checkpoint: `main` reads its config.json once
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    if quant:
        p.add_argument("--quant", choices=["w4a16", "w4a4"] + ["none"] * runs_16_bit, default="w4a16",
                       help="quantize a float --model this way" + (" first (none: run it in 16 bits)" * runs_16_bit))
        p.add_argument("--group-size", type=int, default=None, help="w4a16 group (default: 128, or 64/32 if K needs)")
        p.add_argument("--method", choices=["rtn", "gptq", "awq"], default="rtn",
                       help="round to nearest, or calibrated on the C4 excerpt (gptq, awq)")
        p.add_argument("--rotate", action="store_true", help="w4a4: Hadamard-rotate the model first")
        p.add_argument("--clip-search", action="store_true",
                       help="RTN with the MSE-optimal clipping search (always on for w4a4's per-channel weights; "
                            "gptq and awq run their own calibrated one, so with them it applies only to "
                            "--quantize-lm-head's head)")
        p.add_argument("--quantize-lm-head", action="store_true",
                       help="quantize lm_head too (RTN; kept 16-bit by default, as AutoAWQ / GPTQ do): a faster "
                            "decode step, at some accuracy; a head tied to the embedding is untied, and the embedding "
                            "keeps its 16-bit table, so such a model grows")
        p.add_argument("--float-zero", action="store_true",
                       help="w4a16: float minimum per group (not AWQ/GPTQ-exportable; often more accurate)")
        p.add_argument("--calib-samples", type=int, default=None,
                       help="gptq / awq: calibration windows of the C4 excerpt (default: 128; fewer: faster, "
                            "less accurate)")
        p.add_argument("--calib-seq-len", type=int, default=None,
                       help="gptq / awq: tokens per calibration window, at most the model's context (default: 512, "
                            "or the context where shorter)")


class _HelpWithDefaults(argparse.HelpFormatter):
    """Each option's help ends with its default where one is set and the text does not say it already (`nibble
    eval` quantizes to W4A16 unless --quant says otherwise: a help that hid it measured another model than meant)."""

    def _get_help_string(self, action):
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not unset and "default" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    # light modules, which hold what the options name apart from the torch-heavy ones that the commands' runs import
    from nibble import __version__
    from nibble.eval.report_command import TaskNames, add_report_arguments, report_main
    from nibble.formats import SAVE_FORMATS
    from nibble.qat.command import add_qat_arguments, qat_main

    parser = argparse.ArgumentParser(prog="nibble", description=__doc__)
    parser.add_argument("--version", action="version", version=f"nibble {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser = functools.partial(sub.add_parser, formatter_class=_HelpWithDefaults)
    p = sub.add_parser("generate", help="prompt in, text out")
    _add_model_args(p)
    p.add_argument("prompt", nargs="*", help="one prompt (its text streams as it comes) or several (run as batches "
                                             "by the engine, each printed after its prompt as its batch completes)")
    p.add_argument("--prompts-file", default=None, help="more prompts, one a line (blank lines skipped)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"several prompts: how many the engine runs at once (default: {GENERATE_BATCH_SIZE})")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate at most (with the prompt's, within the model's context)")
    p.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--hf-generate", action="store_true",
                   help="decode with transformers' model.generate instead of nibble's engine (static KV cache, "
                        "CUDA graphs on a GPU; the same greedy tokens up to near-ties)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy; above 0: sample from softmax(logits / temperature)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only (0: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the smallest set of most likely tokens whose probability reaches p")
    p.add_argument("--seed", type=int, default=None, help="seed PyTorch's generators (repeatable samples)")
    p.add_argument("--stats", action="store_true",
                   help="one prompt: say on stderr how many tokens came and how fast (after the first, which "
                        "include the prefill and the engine's graph capture, too)")
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("quantize", help="model in, quantized directory out")
    _add_model_args(p, runs_16_bit=False)
    p.add_argument("--out", required=True, help="the folder the checkpoint is written to")
    p.add_argument("--format", choices=SAVE_FORMATS, default="nibble",
                   help="nibble (every mode), or an AutoAWQ GEMM / GPTQ (gptq: v1, or v2 where a zero point is 0, said) "
                        "checkpoint for other tools (w4a16 with integer zero points and a 16-bit lm_head); given a "
                        "quantized --model, its weights are written in this format as they are, not quantized again")
    p.set_defaults(func=cmd_quantize)
    p = sub.add_parser("info", help="what a quantized directory holds (read from its headers: fast at any size)")
    p.add_argument("dir", help="a nibble, AutoAWQ or GPTQ checkpoint folder")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("eval", help="perplexity (ppl) or zero-shot tasks")
    p.add_argument("what", choices=["ppl", "tasks"],
                   help="ppl: WikiText-2 test perplexity; tasks: the seven zero-shot tasks")
    _add_model_args(p)
    p.add_argument("--seq-len", type=int, default=None,
                   help="ppl: window length (default: the model's context, at most 2048 and --max-tokens; a longer "
                        "one than the context is cut to it, with a warning)")
    p.add_argument("--max-tokens", type=int, default=None, help="ppl: cut the token stream (quick runs)")
    p.add_argument("--tasks", action=TaskNames, default=None,
                   help="tasks: which, comma-separated, e.g. piqa,boolq (default: all seven)")
    p.add_argument("--limit", type=int, default=None, help="tasks: items per task, for quick runs (default: all)")
    p.add_argument("--batch-size", type=int, default=8, help="windows (ppl) or requests (tasks) per forward pass")
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("report", help="accuracy, memory and speed of 16-bit vs W4A16 vs W4A4, side by side")
    add_report_arguments(p)
    p.set_defaults(func=report_main)
    p = sub.add_parser("qat", help="PE-QAT: LoRA + fake-quant training, then export a W4A4 model")
    add_qat_arguments(p)
    p.set_defaults(func=qat_main)
    p = sub.add_parser("build-kernels", help="compile the CUDA kernels ahead of first use (nvcc; cached)")
    p.add_argument("--arch", help="compute capability as digits, e.g. 90 (H100/H200); default: this machine's GPU")
    p.add_argument("--jobs", type=int, default=None, help="nvcc processes at a time (default: the CPUs)")
    p.set_defaults(func=cmd_build_kernels)
    p = sub.add_parser("demo", help="the `make demo` job")
    _add_model_args(p, quant=False)
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens each model generates")
    p.add_argument("--ppl-tokens", type=int, default=1024, help="WikiText-2 tokens the perplexities are taken on")
    p.set_defaults(func=cmd_demo)
    parser.commands = sub.choices  # each command's parser, which says its own usage in an error
    return parser


def user_errors() -> tuple:
    """The exceptions nibble raises about what a user gave it (a path that is not a model or a checkpoint,
    a missing data file or package, a setting the model or config refuses, a kernel that cannot build):
    their messages say what to fix, so the command prints them as one line, not a traceback."""
    from nibble.kernels import KernelUnavailableError
    from nibble.kernels.cuda_build import CudaBuildError

    # OSError: a path that is missing, not a folder or not permitted, and a disk that is full or failing, of a file
    # written or of the output (`nibble info DIR > /dev/full`); ValueError covers
    # nibble.models.checkpoint_files.CheckpointError; FloatingPointError: a training run that diverged (PE-QAT), said
    # with the rates to lower
    return (OSError, ModuleNotFoundError, ValueError, CudaBuildError, KernelUnavailableError, FloatingPointError)


# the options whose smaller value takes less memory, as a command has them (calibration's: where it calibrates)
_MEMORY_OPTIONS = ("batch_size", "seq_len")
_CALIBRATION_MEMORY_OPTIONS = ("calib_samples", "calib_seq_len")


def out_of_memory(args, error: BaseException) -> str:
    """The one line for torch's OutOfMemoryError in ``nibble <args.command>``: torch's own sentence of what did not
    fit (the allocation, the device's size and what is free, without its notes on the allocator), then the command's
    options that take less memory when smaller, with the values given."""
    said = str(error).split(" Including non-PyTorch memory")[0].strip().splitlines()
    calibrates = getattr(args, "method", None) in ("gptq", "awq") or getattr(args, "init", None) == "gptq"
    names = _MEMORY_OPTIONS + _CALIBRATION_MEMORY_OPTIONS * calibrates
    options = [f"--{name.replace('_', '-')}" + ("" if getattr(args, name) is None else f" (now {getattr(args, name)})")
               for name in names if hasattr(args, name)]
    fix = ""
    if options:
        listed = options[0] if len(options) == 1 else f"{', '.join(options[:-1])} or {options[-1]}"
        fix = f"give a smaller {listed}, or "
    return (f"nibble {args.command}: {said[0].rstrip('.') if said else 'out of memory'}: {fix}stop what else holds "
            "the GPU's memory (nvidia-smi lists it)\n(NIBBLE_TRACEBACK=1 shows where it was raised)")


def interrupted(command: str, message: str = "interrupted") -> SystemExit:
    """Ctrl-C in ``nibble <command>``: says ``message`` (what was kept, how to go on) as one line on stderr and gives
    the SystemExit to raise, of status 130 (128 + SIGINT, what a shell gives a command Ctrl-C stopped), so that a
    script can tell an interrupted command from a failed one (status 1)."""
    print(f"\nnibble {command}: {message}", file=sys.stderr)  # "\n": past the "^C" the terminal echoed
    return SystemExit(130)


@contextlib.contextmanager
def _warnings_said_as(prefix: str):
    """Warnings as one line, ``nibble <command>: warning: ...``, as the errors are said: Python's own form printed
    the source path and line of nibble's code that raised it."""
    shown = warnings.formatwarning
    warnings.formatwarning = lambda message, *args, **kwargs: f"{prefix}: warning: {message}\n"
    try:
        yield
    finally:
        warnings.formatwarning = shown


def _drop_stdout() -> None:
    """Point stdout at /dev/null, after a write to it failed (a closed pipe, a full disk): Python flushes what is left
    at exit, into the same failure, and prints that as an exception."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _flush_stdout() -> None:
    """Write out what is left of stdout, or, where it cannot take it (a full disk), drop it (`_drop_stdout`)."""
    try:
        sys.stdout.flush()
    except OSError:
        _drop_stdout()


def main(argv=None):
    parser = build_parser()
    # argparse takes one run of positionals: `generate "a" --max-new-tokens 5 "b"` left "b" over (and its
    # parse_intermixed_args does not take subcommands): what is left that is not an option is more prompts
    args, left = parser.parse_known_args(argv)
    # an option is "-x" or "--xy" without a space, as argparse reads one ("- a list item" is a prompt)
    if args.command == "generate" and not any(a.startswith("-") and " " not in a for a in left):
        args.prompt, left = [*args.prompt, *left], []
    if left:
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(left)}")
    for path in ("model", "out"):  # "--model=~/ckpt": a shell leaves "~" after "=" as it is
        if isinstance(getattr(args, path, None), str):
            setattr(args, path, os.path.expanduser(getattr(args, path)))
    try:
        if hasattr(args, "quantized"):  # the commands of `_add_model_args`: their checks and loading all ask
            from nibble.models.checkpoint_files import quantized_checkpoint
            args.quantized = quantized_checkpoint(args.model)
        if hasattr(args, "quant"):
            check_quant_args(args)  # said before the model loads
        if getattr(args, "out", None) is not None:
            check_out(args.out, getattr(args, "model", None), writes_model=args.command != "report")
        with _warnings_said_as(f"nibble {args.command}"):
            status = args.func(args)  # an exit status (`report`: 1 when a config failed), or None
        sys.stdout.flush()  # what is left to write, here: a full disk is said below, not in Python's exit flush
        return status
    except BrokenPipeError:  # the reader of a pipe left (`nibble generate ... | head -1`): its choice, not an error
        _drop_stdout()
        raise SystemExit(141) from None  # 128 + SIGPIPE, the status of a command a closed pipe stopped
    except user_errors() as e:
        if isinstance(e, OSError):  # the output's own, maybe (`nibble info DIR > /dev/full`: "No space left on device")
            _flush_stdout()
        if os.environ.get("NIBBLE_TRACEBACK") == "1":
            raise
        raise SystemExit(f"nibble {args.command}: {e}\n(NIBBLE_TRACEBACK=1 shows where it was raised)") from None
    except Exception as e:  # torch's OutOfMemoryError (a RuntimeError): a long traceback, the fix nowhere in it
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(e, torch.OutOfMemoryError) or os.environ.get("NIBBLE_TRACEBACK") == "1":
            raise
        raise SystemExit(out_of_memory(args, e)) from None
    except KeyboardInterrupt as e:  # Ctrl-C: one line, not a traceback of wherever the work was
        if os.environ.get("NIBBLE_TRACEBACK") == "1":
            raise
        # one raised with a message says what the command kept and how to go on (qat's, `report.ReportInterrupted`)
        raise interrupted(args.command, str(e) or "interrupted") from None


if __name__ == "__main__":
    sys.exit(main())
