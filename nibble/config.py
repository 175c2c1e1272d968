"""QuantConfig: what to quantize and how; serialised as the checkpoint's `quantization_config`."""
from __future__ import annotations

import numbers
from contextlib import contextmanager
from dataclasses import FrozenInstanceError, asdict, dataclass

import torch

from nibble.formats.int4 import FORMAT_VERSION, PACK, READABLE_FORMAT_VERSIONS, check_group_size

MODES = ("w4a16", "w4a4")
METHODS = ("rtn", "gptq", "awq")
ROTATIONS = ("none", "hadamard")
ZERO_POINTS = ("int", "float")
QUANT_METHOD = "nibble"


# Each mode's group size where none is given (QuantConfig's and QuantLinear's): W4A16 in groups of 128, as AutoAWQ and
# GPTQ checkpoints hold them; W4A4 per output channel (-1), the one scale a row its integer GEMM applies after the sum.
MODE_GROUP_SIZES = {"w4a16": 128, "w4a4": -1}

# The group sizes up to 128 that nibble's CUDA W4A16 kernels run (`check_group_size` says which others run where).
CUDA_KERNEL_GROUP_SIZES = (128, 64, 32)


# The fix quantize_model's refusals of one layer name (a width packing cannot hold, scales float16 cannot); one string,
# so that PE-QAT, which keeps no layer in 16 bits, can say its own (`nibble.qat.train.said_for_pe_qat`)
KEEP_IN_16_BITS = "keep this layer in 16 bits (QuantConfig.modules_to_not_convert)"


def width_error(in_features: int, group_size: int) -> str | None:
    """What is wrong with quantizing a linear of ``in_features`` in groups of ``group_size`` (-1: one group a
    row), or None: INT4 packs 8 codes to an int32 word along in_features, and a group must divide the row. The one
    statement of the rule (QuantLinear, RTN and quantize_model's check before any layer turns); where the group
    does not divide, it names the group sizes that do: the CUDA kernels' (128, 64, 32) first, then other multiples of
    8 up to 128, which only Triton and dequantize + cuBLAS run."""
    if in_features < 1:
        return f"in_features={in_features}: a layer without inputs has nothing to quantize; keep it in 16 bits"
    if in_features % PACK:
        return (f"in_features={in_features} is not a multiple of {PACK}, which INT4 packing needs ({PACK} codes a "
                f"32-bit word): {KEEP_IN_16_BITS}")
    if group_size != -1 and in_features % group_size:
        fits = [g for g in CUDA_KERNEL_GROUP_SIZES if in_features % g == 0]
        others = [g for g in range(128, 7, -8) if in_features % g == 0 and g not in fits][:max(0, 3 - len(fits))]
        which = [f"{' or '.join(map(str, fits))} (CUDA kernels)"] if fits else []
        which += [f"{' or '.join(map(str, others))} (Triton)"] if others else []  # 8 divides it: never both empty
        return (f"in_features={in_features} is not divisible by group_size={group_size}; pick a group size that "
                f"divides it: {', '.join(which)}, or -1 for per-channel")
    return None


def check_count(name: str, value, least: int = 1) -> None:
    """Refuse a count option (the quantizers' ``blocksize``, ``batch_size``, ``n_grid``, ..., the evaluations'
    ``seq_len`` and ``limit``) that is not an integer >= ``least``, by its name: a negative GPTQ blocksize returned a
    layer of zeros as if quantized, a 0 surfaced as range()'s or split()'s message (AWQ's n_grid=0 as ``raise None``),
    and a float as a slice's "indices must be integers" (blamed on a task's data file)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def check_token_ids(model, ids: torch.Tensor, what: str, fix: str) -> None:
    """Refuse integer token ``ids`` (not empty) outside ``model``'s vocabulary (its input embedding's rows), naming
    ``what`` they are and how to ``fix`` them: they failed deep in the embedding (an IndexError on the CPU, a
    device-side assert on a GPU). One min/max and one host sync."""
    vocab = model.get_input_embeddings().num_embeddings
    low, high = torch.stack(torch.aminmax(ids)).tolist()
    if low < 0 or high >= vocab:
        raise ValueError(f"{what} token ids run from {low} to {high}, but the model's vocabulary has {vocab} tokens: "
                         f"{fix}")


def checked_seed(name: str, seed) -> int:
    """``seed`` as the int torch's generators take, refused by ``name`` unless it is an integer in their range, -2**63
    to 2**64 - 1: torch's own refusals ("manual_seed expected a long, but got str", "Overflow when unpacking long
    long") named no option. A numpy integer comes back as an int, which a checkpoint's JSON can hold."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not -2**63 <= seed < 2**64:
        raise ValueError(f"{name} must be an integer from -2**63 to 2**64 - 1, got {seed!r}")
    return int(seed)


@dataclass(frozen=True)
class QuantConfig:
    """``mode="w4a16"``: INT4 weights, 16-bit activations (group-wise, asymmetric by default).
    ``mode="w4a4"``: INT4 weights (symmetric, per output channel) and per-token INT4 activations,
    optionally after a fixed Hadamard rotation of the model (``rotation="hadamard"``); its weights by
    RTN or GPTQ (QuaRot's pairing: GPTQ on the rotated weights, calibrated on 16-bit activations).
    The rotation gives each down_proj an online Hadamard that only W4A4 layers run: a rotated W4A16 model keeps
    its down_projs in 16 bits (``modules_to_not_convert``), as ``quantize_model`` says. ``rotation`` and
    ``rotation_seed`` are the model's as a quantization_config records them: a model rotated before
    (`nibble.models.rotation.rotate_model`) is quantized with ``rotation="none"``, and its config says its seed.

    ``clip_search`` is RTN's weight-space search, for the layers RTN quantizes: every one with ``method="rtn"``;
    with ``"gptq"`` / ``"awq"``, which run their own calibrated clipping searches (GPTQ's Hessian-weighted error,
    AWQ's output error), lm_head alone, where ``modules_to_not_convert`` leaves it out. ``None`` picks the mode's
    default there (on for w4a4, off for w4a16); where RTN quantizes no layer it stays None, as the checkpoint
    records it, and a value is refused (it was taken, recorded, and changed nothing).
    ``group_size=None`` picks the mode's default (128 for w4a16, per-channel for w4a4); ``-1``
    means one group per output channel. 128 does not divide every model's widths (SmolLM2's 576): quantize_model
    then says which size does, the one ``nibble quantize`` picks (`nibble.models.convert.default_group_size`).

    A QuantConfig is checked as a whole when it is made, and cannot be changed after (a field set later slipped
    past the checks: a changed mode kept the other mode's group size, and a str of modules_to_not_convert was read
    as its characters): ``dataclasses.replace(config, field=value)`` makes a changed copy, checked again. The
    defaults of None are resolved when it is made, and a copy keeps them (replace hands it the resolved values, which
    it cannot tell from values set, and a bool field has no room to mark one resolved): ``replace(QuantConfig(),
    mode="w4a4")`` holds W4A16's group_size 128 and asymmetric weights, which W4A4 refuses, and
    ``replace(QuantConfig(mode="w4a4"), mode="w4a16")`` W4A4's per-channel symmetric weights and clip search (a W4A16
    config all the same). To change the mode, build ``QuantConfig(mode=..., ...)``, which resolves them for it.
    ``modules_to_not_convert`` is held as a tuple; one str is one name.
    """

    mode: str = "w4a16"
    group_size: int | None = None
    symmetric: bool | None = None
    zero_point: str = "int"
    clip_search: bool | None = None
    method: str = "rtn"
    rotation: str = "none"
    rotation_seed: int = 0
    modules_to_not_convert: tuple[str, ...] = ("lm_head",)

    def __post_init__(self):
        def resolve(name, value):  # the dataclass is frozen to everyone but this check
            object.__setattr__(self, name, value)

        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {ROTATIONS}, got {self.rotation!r}")
        if self.zero_point not in ZERO_POINTS:
            raise ValueError(f"zero_point must be one of {ZERO_POINTS}, got {self.zero_point!r}")
        for name in ("symmetric", "clip_search"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True, False or None (the mode's default), got {value!r}")
        # refused here, not by torch half-way through the rotation
        resolve("rotation_seed", checked_seed("rotation_seed", self.rotation_seed))
        if self.rotation == "none" and self.rotation_seed != 0:  # ignored: the model quantized unrotated
            raise ValueError(f"rotation_seed={self.rotation_seed} seeds rotation='hadamard', and rotation='none' rotates "
                             "nothing: set rotation='hadamard' too (a model rotated before, by rotate_model, takes "
                             "rotation='none' and seed 0, the defaults: its config records its own seed)")
        if isinstance(self.modules_to_not_convert, str):  # one name, not its characters
            resolve("modules_to_not_convert", (self.modules_to_not_convert,))
        if not (isinstance(self.modules_to_not_convert, (list, tuple))
                and all(isinstance(n, str) for n in self.modules_to_not_convert)):
            raise ValueError(f"modules_to_not_convert must be a list of module names (or dotted parts of them), "
                            f"e.g. ['lm_head'], got {self.modules_to_not_convert!r}")
        resolve("modules_to_not_convert", tuple(self.modules_to_not_convert))  # a list's append checked nothing
        if self.group_size is None:
            resolve("group_size", MODE_GROUP_SIZES[self.mode])
        if self.symmetric is None:
            resolve("symmetric", self.mode == "w4a4")
        by_rtn = _rtn_quantizes_a_layer(self.method, self.modules_to_not_convert)
        if self.clip_search is None and by_rtn:
            # A per-channel range is set by the largest of K weights, so clipping it pays (W4A4); for
            # W4A16 groups of 64-128 the weight-MSE search measured worse perplexity on SmolLM2.
            resolve("clip_search", self.mode == "w4a4")
        if self.clip_search is not None and not by_rtn:
            raise ValueError(f"clip_search={self.clip_search} is RTN's clipping search, and RTN quantizes no layer of "
                             f"this config: method={self.method!r} runs its own calibrated one, and lm_head stays in "
                             "16 bits (modules_to_not_convert): leave it None (a dataclasses.replace copy of an RTN "
                             "config holds its clip_search: give clip_search=None), or take 'lm_head' out of "
                             "modules_to_not_convert to quantize the head by RTN, the one layer it applies to")
        check_group_size(self.group_size)
        if self.mode == "w4a4":
            if not self.symmetric or self.group_size != -1:
                # a copy of a w4a16 config (dataclasses.replace) holds its resolved 128 and asymmetric weights
                raise ValueError(f"w4a4 needs symmetric per-channel weights (symmetric=True, group_size=-1), got "
                                 f"symmetric={self.symmetric}, group_size={self.group_size}: its integer GEMM applies "
                                 "one weight scale per output channel after the int32 sum. Leave them None, w4a4's "
                                 "defaults; a dataclasses.replace copy of a w4a16 config holds the values resolved "
                                 "for w4a16: build QuantConfig(mode='w4a4', ...) instead, which resolves group_size, "
                                 "symmetric and clip_search for w4a4")
            if self.method == "awq":
                raise ValueError("w4a4 supports method='rtn' or 'gptq': AWQ's per-channel scales would move "
                                 "into the activations that W4A4 quantizes per token (PE-QAT recovers more)")
        if self.symmetric and self.zero_point == "float":
            # the symmetric grid, (q - 8) * s, has no zero point to make a float: it was ignored, and the
            # checkpoint still said zero_point 'float'
            raise ValueError("zero_point='float' (CLI --float-zero: a float minimum per group) is for asymmetric w4a16 "
                             "weights; symmetric ones (symmetric=True, and every w4a4 config) have no zero point: "
                             "drop it, or set symmetric=False in w4a16")

    @property
    def activation_bits(self) -> int:
        return activation_bits(self.mode)

    def to_dict(self) -> dict:
        return {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION, "bits": 4,
                "activation_bits": self.activation_bits, **asdict(self),
                "modules_to_not_convert": list(self.modules_to_not_convert)}  # as JSON reads it back

    @classmethod
    def from_dict(cls, d: dict) -> "QuantConfig":
        if d.get("quant_method") != QUANT_METHOD:
            raise ValueError(f"not a nibble quantization_config (quant_method={d.get('quant_method')!r}); "
                             "nibble.load_quantized reads nibble, AutoAWQ (awq) and GPTQ (gptq) checkpoints")
        if d.get("format_version") not in READABLE_FORMAT_VERSIONS:
            raise ValueError(f"checkpoint format_version {d.get('format_version')!r} is not supported by this nibble "
                             f"(it reads versions {READABLE_FORMAT_VERSIONS}); upgrade nibble or re-quantize the model")
        if d.get("bits", 4) != 4:  # written by to_dict; an edited or foreign file held 8-bit weights as 4-bit ones
            raise ValueError(f"bits={d['bits']!r}: nibble's checkpoints hold 4-bit weights")
        mode = d.get("mode", "w4a16")
        if "activation_bits" in d and d["activation_bits"] != activation_bits(mode):
            raise ValueError(f"activation_bits={d['activation_bits']!r} does not go with mode={mode!r} (w4a16: 16, "
                             "w4a4: 4)")
        fields = cls.__dataclass_fields__
        d = {k: v for k, v in d.items() if k in fields}
        if d.get("rotation", "none") == "none":
            d["rotation_seed"] = 0  # a PE-QAT export of another recipe than hadamard wrote the run's unused seed
        skipped = d.get("modules_to_not_convert", ["lm_head"])
        if isinstance(skipped, list) and not _rtn_quantizes_a_layer(d.get("method", "rtn"), skipped):
            d["clip_search"] = None  # saved before a clip_search that no layer ran was refused
        if d.get("symmetric") and d.get("zero_point") == "float":
            d["zero_point"] = "int"  # saved before such configs were refused: the weights are symmetric all the same
        return cls(**d)


def activation_bits(mode: str) -> int:
    return 4 if mode == "w4a4" else 16


def _rtn_quantizes_a_layer(method: str, modules_to_not_convert) -> bool:
    """Whether RTN quantizes a layer, which ``clip_search`` is for: every one for method 'rtn'; for the calibrated
    methods lm_head alone, when ``modules_to_not_convert`` leaves it out (only the entry "lm_head" names it, by
    `nibble.models.convert`'s rule of whole dotted parts)."""
    return method == "rtn" or "lm_head" not in modules_to_not_convert


def _read_only(config: QuantConfig, name: str, value) -> None:
    raise FrozenInstanceError(f"a QuantConfig cannot be changed once made, where its fields are checked together: "
                              f"make a changed copy, checked again, with dataclasses.replace(config, {name}=...)")


QuantConfig.__setattr__ = _read_only  # frozen's own refusal, "cannot assign to field", said what to do instead


def resolve_device(device=None) -> torch.device:
    """``device`` as a torch.device; None picks the GPU when one is visible, else the CPU. A CUDA device
    asked for where no GPU is visible is refused by name (ValueError), before any work."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, int) and not isinstance(device, bool):  # torch's spelling of cuda:N, which torch.device
        device = f"cuda:{device}"  # refuses without a GPU as "Cannot access accelerator device"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a device torch knows: use 'cpu', 'cuda' or 'cuda:N'") from e
    if device.type not in ("cpu", "cuda"):  # "meta" failed as buffers the checkpoint lacks, "mps" as other weights
        raise ValueError(f"device {str(device)!r} is not one nibble runs on: use 'cpu', 'cuda' or 'cuda:N'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but no CUDA GPU is visible: use the CPU (device 'cpu', "
                         "CLI --device cpu) or run where a GPU is")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    # bf16 halves GPU memory and runs on tensor cores; most CPUs lack fast bf16 matmuls.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def resolve_dtype(dtype) -> torch.dtype | None:
    """``dtype`` as a float torch.dtype (None stays None: the caller's default), also from its name ("bfloat16",
    "torch.float16", as transformers takes it); anything else is refused by name before any work."""
    if dtype is None or dtype in FLOAT_DTYPES:
        return dtype
    named = getattr(torch, str(dtype).removeprefix("torch."), None) if isinstance(dtype, str) else None
    if named not in FLOAT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one nibble runs a model in: use torch.bfloat16, torch.float16 or "
                         "torch.float32 (or their names)")
    return named


def checked_cast(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """A loader's float tensor ``t`` (the checkpoint's ``name``) in ``dtype``, refused where a finite value of it lies
    beyond ``dtype``'s range: cast, it became Inf, and the model answered NaN without a word (a bfloat16 checkpoint's
    embedding or bias loaded in float16). One pass over the tensor where the cast narrows its range."""
    cast = t.to(dtype)
    if t.is_meta or torch.finfo(dtype).max >= torch.finfo(t.dtype).max:
        return cast
    beyond = torch.isinf(cast) & torch.isfinite(t)
    if bool(beyond.any()):
        wider = " or ".join(str(d) for d in FLOAT_DTYPES if torch.finfo(d).max > torch.finfo(dtype).max)
        raise ValueError(f"{name} holds {int(beyond.sum())} value(s) beyond {dtype}'s range (e.g. "
                         f"{t[beyond][0].item():.6g}), which would load as Inf there and make the model's outputs NaN: "
                         f"load the model in {wider} (the loader's dtype)")
    return cast


def check_finite(t: torch.Tensor, name: str) -> None:
    """Refuse a checkpoint's float tensor ``t`` (its ``name``) holding NaN or Inf: no quantizer writes one, and the
    model would answer NaN, found only at generation."""
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise ValueError(f"{name} holds {bad} NaN or Inf value(s): the checkpoint is corrupt, or its quantization "
                         "overflowed float16; re-download it or quantize the model again")


def recorded_dtype(config: dict) -> torch.dtype | None:
    """The float dtype a config.json records (``dtype``, transformers 5's key, or ``torch_dtype``, earlier versions'),
    None where it records none of `FLOAT_DTYPES`."""
    recorded = getattr(torch, str(config.get("dtype") or config.get("torch_dtype")), None)
    return recorded if recorded in FLOAT_DTYPES else None


@contextmanager
def optional_dependency(package: str, extra: str, what: str):
    """Imports under it that miss the optional ``package`` fail as one line saying what needs it and the pip extra
    that brings it (ModuleNotFoundError, which the CLI says as such), not as "No module named ..."."""
    try:
        yield
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != package:
            raise
        raise ModuleNotFoundError(f"{what} needs {package}, which is not installed: pip install 'nibble[{extra}]'",
                                  name=package) from e
