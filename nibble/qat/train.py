"""PE-QAT: parameter-efficient quantization-aware training for W4A4 (frozen weights, LoRA, fake quant).

Recipes (`RECIPES`):

- ``per-token``: the deployable variant. Activations per token (the W4A4 kernel's numerics),
  weights per output channel with a learnable clip ratio ``sigmoid(theta)`` per channel, started
  from rtn's MSE clip search. Exports to QuantLinear "w4a4".
- ``hadamard``: `rotate_model` first (RMSNorm folded, residual stream rotated by a seeded
  Hadamard, online Hadamard before down_proj); nothing learned but LoRA. The weight clip ratio is
  fixed at what rtn's search picks on the rotated weights, so step 0 is W4A4 Hadamard RTN (exactly, but for rows
  whose scale is below float16's normal range: `FakeQuantLinear.init_clip_from_search`).
  Exports to QuantLinear "w4a4" with ``input_hadamard`` on down_proj.
- ``per-channel``: the original PE-QAT (for comparison): per-input-channel activation scales with
  learnable clipping, learnable per-channel smoothing (``x / m``, ``W * m`` folded into the weight
  before quantization) and learnable weight clipping. No W4A4 kernel can apply a scale per input
  channel after the integer sum, so this recipe trains and evaluates as fake quant only.

Every recipe: base weights frozen, LoRA (peft) on every linear `quantize_model` would convert
(not lm_head), adapters merged into the weight *before* fake quantization (`fake_quant.py`).

Start (``init``): ``"rtn"`` quantizes ``W + s B A`` from the 16-bit weights W, as above. ``"gptq"``
(per-token and hadamard recipes) first runs GPTQ on the (rotated) model, as `quantize_model` with
``method="gptq"`` does, and trains ``Qw(W_gptq + s B A)`` on GPTQ's scales, W_gptq being GPTQ's
compensated weights (`gptq_start` says why those): step 0 is exactly the W4A4 GPTQ model. The
16-bit W stays the teacher. (A learned clip ratio starts at most at `fake_quant.MAX_INIT_RATIO`, so
for the per-token recipe step 0 is GPTQ's codes on slightly narrower scales where its ratio is higher.)

Objective: KL(p_16bit || p_quant) of the next-token distributions (``objective="kl"``, default),
with next-token cross-entropy (``"ce"``) and their sum (``"ce+kl"``) available. Why KL: what QAT
has to recover is the 16-bit model, and the gap we report is to that model's perplexity. The 16-bit
logits are a dense target (a whole 49k-way distribution per token instead of one observed token),
so the few hundred thousand tokens of calibration text go much further, and the student is not
pulled towards the calibration corpus (C4 excerpt, one Jane Austen novel) as CE fine-tuning would:
a CE-trained model can lower its loss by learning Austen rather than by undoing quantization
error, and that shift is invisible in the training loss. The teacher costs no memory: it is the same
model with the adapters and fake quantization switched off, one extra no-grad forward per step.

Training: AdamW, linear warm-up then cosine decay to 0, gradient clipping at 1, bf16 autocast on
CUDA (master weights and the quantization grid stay float32), gradient checkpointing, a tqdm bar
with the step's loss and the mean of the last `FINAL_LOSS_STEPS`. Every ``save_every`` steps (and at the end)
the trainable state (LoRA, clip and smoothing parameters), the optimizer, the scheduler and the step go atomically to
``out_dir/qat-state/state.pt``, with the run's settings: the 16-bit model and the token ids it trains on and
calibrates with among them (`model_record`, `token_record`; the export records them too). ``resume=True`` rebuilds
the same model and continues from it, or refuses, before the model is prepared, a run of other settings; a run
without it into an ``out_dir`` that holds a state is refused, so that no run is lost to a forgotten --resume.
The data order is a pure function of (seed, step), so a resumed run sees the batches an
uninterrupted one would have.
"""
from __future__ import annotations

import collections
import hashlib
import math
import numbers
import os
import pickle
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import PeftModel
from torch import nn
from tqdm.auto import tqdm

from nibble.config import KEEP_IN_16_BITS, QuantConfig, check_count, check_token_ids, checked_seed, resolve_device
from nibble.models.architecture import check_architecture, check_calibration_ids
from nibble.models.checkpoint_files import atomic_write, checkpoint_dir
from nibble.models.convert import check_not_quantized, check_quantizable, refuse_save_pretrained
from nibble.qat import DEFAULT_SOURCES, INITS, OBJECTIVES, RECIPES
from nibble.qat.export import export  # noqa: F401  (the API: run_qat -> export)
from nibble.qat.fake_quant import FakeQuantLinear, FakeQuantLoraLinear, fake_quant_layers, quantization_disabled
from nibble.quantize.rtn import naming
from nibble.warn import warn

STATE_DIR = "qat-state"
STATE_FILE = "state.pt"
# The run's ``final_loss`` is the mean loss of its last FINAL_LOSS_STEPS steps (all of a shorter run's), recorded
# with ``final_loss_steps``, how many it averaged: one step's loss is one batch's, noisy with the batch.
FINAL_LOSS_STEPS = 10
GPTQ_START = QuantConfig(mode="w4a4", method="gptq")  # the quantization init="gptq" starts from (`gptq_start`)

# Recipe -> how each FakeQuantLinear is built.
_LAYER_KWARGS = {
    "per-token": dict(clip="learned", act="token"),
    "hadamard": dict(clip="fixed", act="token"),
    "per-channel": dict(clip="learned", act="channel", smoothing=True),
}
DEFAULT_SAVE_EVERY = 50  # steps between the states a run with an out_dir saves
DEFAULT_QUANT_LR = 1e-2  # the rate of the quantization parameters, for the recipes that learn them


def learns_quantization(recipe: str) -> bool:
    """Whether ``recipe`` learns quantization parameters (clip ratios, smoothing), which train at ``quant_lr``: the
    hadamard recipe learns LoRA alone, its clip ratios fixed, so a quant_lr changes nothing in its run."""
    kwargs = _LAYER_KWARGS[recipe]
    return kwargs["clip"] == "learned" or kwargs["act"] == "channel" or kwargs.get("smoothing", False)


def checked_quant_lr(recipe: str, quant_lr: float | None) -> float | None:
    """The ``quant_lr`` a run of ``recipe`` trains at: `DEFAULT_QUANT_LR` where none is given; None for a recipe
    that learns no quantization parameters, with a warning where one was given (it trained nothing, and a resume at
    another one was refused as another run)."""
    if not learns_quantization(recipe):
        if quant_lr is not None:
            warn(f"quant_lr={quant_lr} has no effect: recipe {recipe!r} learns no quantization parameters (its clip "
                 "ratios are fixed), only LoRA, at lr; drop quant_lr")
        return None
    return DEFAULT_QUANT_LR if quant_lr is None else quant_lr


# ----------------------------------------------------------------------------------------------
# Model preparation
# ----------------------------------------------------------------------------------------------

def quantizable_linears(model: nn.Module) -> list[str]:
    """Full names of the linears a W4A4 `quantize_model` converts by default (decoder layers, not lm_head)."""
    from nibble.models.convert import linears_to_convert

    return linears_to_convert(model, QuantConfig(mode="w4a4"))


@torch.no_grad()
def gptq_start(model: nn.Module, names: list[str], calibration, progress: bool = True) -> dict:
    """GPTQ's W4A4 start of the linears ``names``: {name: (weight [N, K], scales [N, 1])}.

    The weight is GPTQ's compensated weight (each column as GPTQ rounded it, after the error feedback
    of the columns before it), not its dequantized one: on those scales it rounds to GPTQ's codes
    exactly, but it lies anywhere within its rounding bins, as a 16-bit weight does, where the
    dequantized weight sits at their centres, half a step from any change of code, and LoRA's small
    early deltas would move nothing. The model's own weights are given back afterwards (GPTQ
    overwrites them with their quantized values so that later blocks calibrate on the quantized
    model): they stay the 16-bit teacher.
    """
    from nibble.quantize.gptq import gptq_quantize_model

    originals = {name: model.get_submodule(name).weight.detach().clone() for name in names}
    compensated = {}
    weights = gptq_quantize_model(model, GPTQ_START, calibration, progress=progress, compensated=compensated)
    for name, w in originals.items():
        model.get_submodule(name).weight.copy_(w)
    return {name: (compensated[name], weights[name].scales.t()) for name in names}


def check_recipe(recipe: str, init: str, rotation_seed: int = 0, calibration=None) -> None:
    """Refuse a recipe, start, rotation seed and calibration PE-QAT cannot take (together), before any work."""
    checked_seed("rotation_seed", rotation_seed)  # torch's refusal came after the model was cast and prepared
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if rotation_seed != 0 and recipe != "hadamard":  # dropped without a word, as QuantConfig refuses
        raise ValueError(f"rotation_seed={rotation_seed} seeds the hadamard recipe's rotation, and recipe {recipe!r} "
                         "rotates nothing: drop it, or train recipe='hadamard' (a model rotated before, by "
                         "rotate_model, keeps the seed it was rotated with)")
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if calibration is not None and init != "gptq":  # it was ignored without a word
        raise ValueError(f"calibration is GPTQ's (init='gptq'), and init={init!r} quantizes from the 16-bit weights, "
                         "calibrating nothing: drop calibration, or start from GPTQ's weights with init='gptq'")
    if init == "gptq" and recipe == "per-channel":
        # worded for `nibble.cli.options_named`, which says each "init" / "recipe" as the option
        raise ValueError("init='gptq' is for the deployable recipes, 'per-token' and 'hadamard': per-channel learns a "
                         "smoothing that rescales the weight GPTQ would have quantized; give init='rtn' or another "
                         "recipe")


def start_config(recipe: str, init: str, rotation_seed: int = 0) -> QuantConfig:
    """The post-training quantization a run of ``recipe`` and ``init`` starts from and `export` deploys: W4A4, per
    output channel, rotated by the Hadamard recipe."""
    rotation = "hadamard" if recipe == "hadamard" else "none"
    return QuantConfig(mode="w4a4", method=init, rotation=rotation, rotation_seed=rotation_seed)


# What a PE-QAT user can do where quantize_model's refusals of a layer INT4 cannot take say `KEEP_IN_16_BITS`, an
# option PE-QAT lacks: it fake-quantizes every linear of the decoder layers (`quantizable_linears`)
PE_QAT_KEEPS_NONE = ("quantize the model without PE-QAT, which can keep no layer in 16 bits (nibble.quantize_model "
                     "keeps it with QuantConfig.modules_to_not_convert)")


@contextmanager
def said_for_pe_qat():
    """A refusal of quantize_model's checks or quantizers raised inside, its hint to keep the layer in 16 bits said as
    what a PE-QAT user can do instead (`PE_QAT_KEEPS_NONE`); the exception keeps its type and traceback."""
    try:
        yield
    except ValueError as e:
        said = str(e).replace(KEEP_IN_16_BITS, PE_QAT_KEEPS_NONE)
        if said != str(e):
            e.args = (said,)
        raise


def check_rank(model: nn.Module, rank: int) -> None:
    """Refuse a LoRA rank past what any adapted linear can use: ``B A`` has rank at most min(in_features,
    out_features), so a larger rank adds rank x (in + out) parameters a layer that change nothing, and a huge one ran
    out of memory deep inside peft. The limit is the largest such min over the linears (a rank between the smallest
    and it still adds freedom to the wider ones). Not an integer >= 1, peft's refusal came after the model was
    rotated and its linears replaced."""
    check_count("rank", rank, 1)
    widest = max(quantizable_linears(model), key=lambda n: min(model.get_submodule(n).weight.shape))
    limit = min(model.get_submodule(widest).weight.shape)
    if rank > limit:
        # said without the bare word "rank" but for the parameter, which `nibble.cli.options_named` says as --rank
        raise ValueError(f"rank={rank} exceeds what LoRA can use on this model: an adapter's B A spans at most "
                         f"min(in_features, out_features) dimensions of its linear's, {limit} at most here ({widest}); "
                         f"give rank <= {limit}")


def check_model(model: nn.Module, recipe: str, init: str, rotation_seed: int = 0, rank: int | None = None) -> None:
    """Refuse what PE-QAT cannot train: a model it prepared already (run_qat changes the model it is given in place:
    run again on it, the Hadamard recipe rotated it a second time, so that its teacher was no longer the 16-bit
    model, and fake-quantized the first run's LoRA matrices), another architecture, a quantized model, and what
    `quantize_model` refuses of the same quantization (`start_config`) before it touches the model: weights on the
    meta device, a model the Hadamard recipe cannot rotate, a width INT4 cannot pack, a weight holding NaN or Inf or,
    from RTN's start, too large or too small for float16 scales. Found later, these were said after the model was cast
    and prepared (the rotation's), or after the whole training (the packing's, at the export), or as a scale overflow
    of |w| = nan without the layer's name (NaN and Inf). Their hint to keep a layer in 16 bits is said as PE-QAT's
    (`said_for_pe_qat`). With ``rank``, a LoRA rank no linear can use (`check_rank`)."""
    if fake_quant_layers(model):
        raise ValueError("the model was prepared for PE-QAT already (run_qat changes the model it is given in place): "
                         "give it a fresh 16-bit model, e.g. a copy.deepcopy made before the first run")
    check_architecture(model)
    check_not_quantized(model, "PE-QAT")  # by PE-QAT's name, before check_quantizable's own
    with said_for_pe_qat():
        check_quantizable(model, start_config(recipe, init, rotation_seed))
    if rank is not None:
        check_rank(model, rank)


# Why a PE-QAT model saves only through nibble: what it trained is more than its LoRA weights, and every way of saving
# less loaded back elsewhere as another function without a word (a Hadamard run's adapter, on the unrotated model
# by peft's PeftModel.from_pretrained: the test's tiny Llama's logits 2.0 apart at 3.6 the largest).
SAVE_REFUSED = (
    "a PE-QAT model is not its LoRA adapter nor its merged 16-bit weights: the adapters were trained merged into the "
    "weights before fake quantization, on the model as the recipe prepared it (hadamard: rotated, RMSNorm folded, an "
    "online Hadamard before down_proj; the clip ratios it fixed or learned; init='gptq': GPTQ's start weights), and "
    "peft's PeftModel.from_pretrained onto the 16-bit model, or transformers' from_pretrained of the merged one, runs "
    "none of that. Keep what nibble reads back: nibble.qat.train.export(model, directory, tokenizer) writes the "
    "deployable W4A4 model (nibble.load_quantized), and run_qat(out_dir=...) / nibble qat --out keep the state "
    "(qat-state/state.pt) from which run_qat with the same arguments and resume=True rebuilds this model")


class QatPeftModel(PeftModel):
    """The PeftModel PE-QAT trains. Its ``save_pretrained`` is refused (`SAVE_REFUSED`): peft writes the LoRA weights
    alone, which no loader but PE-QAT's own preparation runs as trained (the model it prepared refuses
    ``save_pretrained`` too, for its ``merge_and_unload``). ``merge_and_unload`` works (`FakeQuantLoraLinear.merge`)."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        raise ValueError(SAVE_REFUSED)

    def merge_and_unload(self, *args, **kwargs) -> nn.Module:
        """peft's, keeping the run's description (`export` records the run's settings from it)."""
        merged = self.base_model.merge_and_unload(*args, **kwargs)
        merged.qat_meta = dict(getattr(self, "qat_meta", {}))
        return merged


def qat_description(recipe: str, init: str, rank: int, alpha: float | None, rotation_seed: int) -> dict:
    """How `prepare_qat_model` makes the model: the start of its ``qat_meta`` and of a run's settings."""
    return {"recipe": recipe, "init": init, "rank": rank, "alpha": 2 * rank if alpha is None else alpha,
            "rotation_seed": rotation_seed}


def prepare_qat_model(model: nn.Module, recipe: str, rank: int = 16, alpha: float | None = None,
                      rotation_seed: int = 0, init: str = "rtn", calibration=None, progress: bool = True) -> nn.Module:
    """Rotate (hadamard recipe), swap every quantizable linear for a FakeQuantLinear, add LoRA with peft.

    ``init="gptq"`` starts quantization from GPTQ's weights, calibrated on ``calibration`` (token ids
    [n, seq_len], see `nibble.quantize.calibration.calibration_batches`), checked as `quantize_model` checks its
    calibration (`architecture.check_calibration_ids`); see the module doc.
    Returns the PeftModel; only LoRA and the recipe's quantization parameters are trainable.
    """
    from peft import LoraConfig

    check_recipe(recipe, init, rotation_seed, calibration)
    check_alpha(alpha)
    if init == "gptq" and calibration is None:
        raise ValueError("init='gptq' needs calibration token ids (nibble.quantize.calibration.calibration_batches)")
    check_model(model, recipe, init, rotation_seed, rank)
    if init == "gptq":
        check_calibration_ids(model, calibration)
    meta = qat_description(recipe, init, rank, alpha, rotation_seed)
    if recipe == "hadamard":
        from nibble.models.rotation import rotate_model
        rotate_model(model, seed=rotation_seed)
    for p in model.parameters():
        p.requires_grad_(False)
    names = quantizable_linears(model)
    with said_for_pe_qat():  # a scale past float16 after the rotation, found by GPTQ or the clip search
        starts = gptq_start(model, names, calibration, progress) if init == "gptq" else {}
        for name in names:
            linear = model.get_submodule(name)
            with naming(name):
                layer = FakeQuantLinear.from_linear(linear, start=starts.pop(name, None), **_LAYER_KWARGS[recipe])
            model.set_submodule(name, layer)
    config = LoraConfig(r=rank, lora_alpha=meta["alpha"], lora_dropout=0.0, target_modules=names, bias="none")
    config._register_custom_module({FakeQuantLinear: FakeQuantLoraLinear})
    config.base_model_name_or_path = getattr(model, "name_or_path", None)  # as get_peft_model records it
    peft_model = QatPeftModel(model, config)
    for _, m in fake_quant_layers(peft_model):  # peft freezes everything that is not "lora_"
        for p in (getattr(m, a, None) for a in ("clip_logit", "act_clip_logit", "smooth_log")):
            if p is not None:
                p.requires_grad_(True)
    # on the base model, which the rotation changed: `export` of either model records it (the PeftModel's
    # attribute lookups fall through to it)
    model.qat_meta = meta
    refuse_save_pretrained(model, SAVE_REFUSED)  # `export` marks what it makes as a quantized model's save instead
    return peft_model


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------

def training_windows(tokenizer, seq_len: int, sources=DEFAULT_SOURCES) -> torch.Tensor:
    """Every non-overlapping ``seq_len``-token window of the calibration texts: LongTensor [n, seq_len].

    Texts come from `nibble.quantize.calibration.calibration_text` (which refuses WikiText-2 test).
    """
    from nibble.eval.perplexity import encode
    from nibble.quantize.calibration import calibration_text

    chunks = []
    for source in sources:
        ids = torch.tensor(encode(tokenizer, calibration_text(source), add_special_tokens=False), dtype=torch.long)
        n = ids.numel() // seq_len
        chunks.append(ids[: n * seq_len].view(n, seq_len))
    windows = torch.cat(chunks)
    if windows.shape[0] == 0:
        raise ValueError(f"the calibration text {list(sources)} is shorter than one window of seq_len={seq_len}")
    return windows


def training_sources(sources) -> list[str]:
    """``sources`` as the list of names and paths `training_windows` reads: one str or Path is one source, as
    `calibration_text` takes it (a str was read as its characters), each a str (the state file's settings hold them,
    and torch.load(weights_only=True) refused a Path there, "cannot be read: the file is damaged" at the resume);
    a text named twice is refused (its windows trained twice as often, without a word)."""
    sources = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    sources = [os.fspath(s) if isinstance(s, os.PathLike) else s for s in sources]
    repeated = sorted({s for s in sources if sources.count(s) > 1})
    if repeated:
        raise ValueError(f"sources names {', '.join(map(repr, repeated))} more than once: name each text once")
    return sources


def token_record(ids: torch.Tensor) -> str:
    """How a run's settings record the token ids it trained on or calibrated with: a resume from other ones (another
    --calib-samples, a changed text) mixed two runs without a word, and the export said nothing of them."""
    digest = hashlib.sha256(ids.cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
    return f"{ids.shape[0]} x {ids.shape[1]} tokens, sha256 {digest}"


def model_record(model: nn.Module) -> str:
    """How a run's settings record the 16-bit model it starts from: a resume onto another model of the same shape (a
    fine-tune, the Instruct variant) went on from the saved LoRA and clips without a word. The first and last 64
    values of each tensor, as reading all of them would cost seconds a GB, and another model differs in all of them."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        flat = t.detach().reshape(-1)
        h.update(name.encode() + torch.cat([flat[:64], flat[-64:]]).float().cpu().numpy().tobytes())
    return f"sha256 {h.hexdigest()[:16]} of sampled weights"


def batch_indices(step: int, batch_size: int, n: int, seed: int) -> torch.Tensor:
    """Rows of the window table used at ``step``: consecutive slices of one seeded permutation per epoch."""
    out = []
    for j in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(j, n)
        # modulo 2**64: within the generators' range for any seed (2**64 - 1 went past it after the model loaded)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed((seed * 100_003 + epoch) % 2**64))
        out.append(perm[pos])
    return torch.stack(out)


# ----------------------------------------------------------------------------------------------
# Loss, optimizer, schedule
# ----------------------------------------------------------------------------------------------

def qat_loss(logits: torch.Tensor, input_ids: torch.Tensor, teacher_logits: torch.Tensor | None,
             objective: str) -> torch.Tensor:
    """Next-token loss over every position that has a target (the last position has none)."""
    student = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    loss = 0.0
    if objective in ("ce", "ce+kl"):
        loss = loss + F.cross_entropy(student, input_ids[:, 1:].reshape(-1))
    if objective in ("kl", "ce+kl"):
        teacher = teacher_logits[:, :-1].float().reshape(-1, teacher_logits.shape[-1])
        loss = loss + F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True,
                               reduction="batchmean")
    return loss


def _param_groups(model: nn.Module, lr: float, quant_lr: float | None):
    lora = [p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]
    quant = [p for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    groups = [{"params": lora, "lr": lr, "weight_decay": 0.0}]
    if quant:
        groups.append({"params": quant, "lr": quant_lr, "weight_decay": 0.0})
    return groups


def check_positive(name: str, value, why: str) -> None:
    """Refuse a number of the training (a rate, LoRA's alpha, the clipping bound) that is not finite in float32 and
    > 0, by its ``name``, saying ``why`` it must be: one past float32's largest (lr=1e39) passed, then failed in AdamW
    with torch's "value cannot be converted to type float without overflow" once the model was prepared."""
    largest = torch.finfo(torch.float32).max
    if isinstance(value, bool) or not (isinstance(value, numbers.Real) and 0 < value <= largest):  # NaN fails too
        raise ValueError(f"{name} must be a finite number > 0, at most float32's {largest:.1e} ({why}), got "
                         f"{value!r}")


def check_learning_rates(lr: float, quant_lr: float | None) -> None:
    """NaN trained and was exported as an all-NaN model (and written to config.json as the invalid JSON NaN); a
    negative rate ascends the loss. A quant_lr of None (the recipe's default, `checked_quant_lr`) passes."""
    for name, value in (("lr", lr), ("quant_lr", quant_lr)):
        if value is not None or name == "lr":
            check_positive(name, value, "e.g. 1e-3")


def check_alpha(alpha: float | None) -> None:
    """LoRA's scale is alpha / rank: alpha=0 trained nothing without a word (the export was the step-0 model), a
    negative one was taken, NaN was said as "lower lr"."""
    if alpha is not None:  # None: 2 * rank
        check_positive("alpha", alpha, "LoRA's scale is alpha / rank; leave it None for 2 * rank")


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 to 0 at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------

def _trainable_state(model: nn.Module) -> dict:
    state = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
    for name, m in fake_quant_layers(model):
        if hasattr(m, "clip_ratio"):
            state[f"{name}.clip_ratio"] = m.clip_ratio.detach().cpu().clone()
    return state


def state_path(out_dir) -> Path:
    return Path(out_dir) / STATE_DIR / STATE_FILE


def save_state(path: Path, model, optimizer, scheduler, step: int, settings: dict, losses: dict) -> None:
    """Atomic, as a checkpoint's files are written (`checkpoint_files.atomic_write`): a kill mid-write leaves the
    previous state, and Ctrl-C no temporary beside it. ``losses`` (the run's first loss and its last
    `FINAL_LOSS_STEPS` losses) go with it, so a resumed run records the whole run's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "settings": settings, "trainable": _trainable_state(model),
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "losses": losses}
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_state(path: Path) -> dict:
    """The state `save_state` wrote at ``path``; a damaged one is said as such."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, KeyError, pickle.UnpicklingError) as e:  # torch.load's, by how the file is cut
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {str(e)[:80]}): the file is damaged; delete "
                         "it to train from step 0, or pick another folder") from e


def check_new_run(out_dir) -> None:
    """Refuse a run from step 0 (no resume) into ``out_dir`` where a run's state lies: its first save replaced that
    run's, another model's too, without a word, and a forgotten --resume lost hours of training."""
    path = state_path(out_dir)
    if path.exists():
        raise ValueError(f"{out_dir} holds a PE-QAT run at step {load_state(path)['step']} ({STATE_DIR}/"
                         f"{STATE_FILE}): pass resume=True to go on from it, or another folder to start afresh")


def read_state(path: Path, settings: dict) -> dict:
    """The state `save_state` wrote at ``path``, refused unless a run of ``settings`` can go on from it: read before
    the model is prepared, so that a resume with another option is said before the GPTQ start (minutes on a CPU)."""
    state = load_state(path)
    # the learning rates too: the optimizer and scheduler states `restore_state` loads carry the saved ones, which would
    # keep driving the run while its settings (and the export's config) recorded the new
    # quant_lr only where the recipe learns at it: a hadamard state records the one its run was given (0.01 by default
    # before `checked_quant_lr`), which trained nothing
    fixed = ("model", "recipe", "init", "rank", "alpha", "rotation_seed", "seq_len", "batch_size", "seed",
             "objective", "sources", "windows", "calibration", "lr", "warmup", "max_grad_norm") + (
        ("quant_lr",) if learns_quantization(settings["recipe"]) else ())
    # states written before init existed started from RTN; those written before the model, token ids, warm-up and
    # clipping were recorded cannot be checked for them
    unrecorded = ("model", "windows", "calibration", "warmup", "max_grad_norm")
    saved = {"init": "rtn", **{k: settings[k] for k in unrecorded}, **state["settings"]}
    diff = {k: (saved.get(k), settings.get(k)) for k in fixed if saved.get(k) != settings.get(k)}
    if "recipe" in diff:
        diff.pop("quant_lr", None)  # the recipe's own (None where it learns no quantization): not a second change
    if "init" in diff:
        diff.pop("calibration", None)  # the GPTQ start's token ids (None from RTN's): likewise
    if "rank" in diff and all(a == 2 * r for a, r in zip(diff.get("alpha", (0, 0)), diff["rank"])):
        diff.pop("alpha")  # 2 x rank, its default, in both: the rank's change
    if diff:
        said = "; ".join(f"{k} saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"{path} was written by a run with other settings ({said}): resume with the same model and "
                         "settings or pick another folder")
    if state["step"] > settings["steps"]:  # it trained nothing and recorded the shorter run
        raise ValueError(f"{path} holds a run at step {state['step']}, past steps={settings['steps']}: resume with "
                         f"steps >= {state['step']}, or pick another folder")
    if state["settings"].get("steps") != settings.get("steps"):
        warn(f"resuming a run planned for {state['settings'].get('steps')} steps with steps={settings.get('steps')}: "
             "the cosine schedule is stretched to the new length")
    return state


def restore_state(state: dict, path: Path, model, optimizer, scheduler) -> tuple[int, dict]:
    """Restore ``state`` (`read_state`) into a freshly prepared model; returns the step to run next and the losses
    saved with it (none in states written before they were)."""
    trainable = state["trainable"]
    own = _trainable_state(model)
    if set(trainable) != set(own):
        missing, extra = sorted(set(own) - set(trainable)), sorted(set(trainable) - set(own))
        raise ValueError(f"{path} does not match this model (missing {missing[:3]}, unexpected {extra[:3]})")
    model.load_state_dict(trainable, strict=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["step"], state.get("losses", {})


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------

class QatInterrupted(KeyboardInterrupt):
    """Ctrl-C in `run_qat`, saying which state it leaves: ``saved_step`` is the step of the state at ``path`` that this
    run wrote or resumed from (None: none yet, and no other run's is there: `check_new_run`)."""

    def __init__(self, path: Path | None, saved_step: int | None, first_save: int):
        self.path, self.saved_step = path, saved_step
        if path is None:
            kept = "nothing is kept (no out_dir)"
        elif saved_step is not None:
            kept = f"{path} holds this run at step {saved_step}: run it again with resume=True to go on from there"
        else:
            kept = f"this run saved no state yet (its first at step {first_save})"
        super().__init__(f"PE-QAT interrupted; {kept}")


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@dataclass
class _Run:
    """A `run_qat` call as `_checked_run` resolved it: defaults filled in, seq_len and batch_size clamped, the
    training windows and GPTQ's calibration made, the state to resume from read. ``settings`` is what the saved state
    and ``qat_meta`` record of it (``warmup`` as given: None is the default's). ``saved_step`` is the step of the
    state on disk this run can go on from (None: none yet): the loop moves it on as it saves, and a Ctrl-C
    (`QatInterrupted`) or a divergence (`_diverged`) names it."""

    recipe: str
    steps: int
    lr: float
    quant_lr: float | None
    warmup: int
    objective: str
    max_grad_norm: float
    seed: int
    seq_len: int
    batch_size: int
    windows: torch.Tensor
    calibration: torch.Tensor | None
    device: torch.device
    save_every: int
    path: Path | None
    settings: dict
    state: dict | None
    saved_step: int | None


class _LossRecord:
    """The losses a run records: step 1's and the last `FINAL_LOSS_STEPS`. Saved with the state (`save_state`), so
    that a resumed run records the whole run's."""

    def __init__(self, saved: dict):
        # a state written before the last losses were kept holds a running average instead, not taken as theirs
        self.first = saved.get("first")
        self.recent = collections.deque(saved.get("recent", ()), maxlen=FINAL_LOSS_STEPS)

    def add(self, loss: float) -> None:
        self.recent.append(loss)
        if self.first is None:
            self.first = loss

    def saved(self) -> dict:
        return {"first": self.first, "recent": list(self.recent)}

    def meta(self) -> dict:
        """What ``qat_meta`` records of them."""
        return dict(first_loss=self.first, final_loss=statistics.fmean(self.recent) if self.recent else None,
                    final_loss_steps=len(self.recent))


def _check_options(objective, steps, seq_len, batch_size, save_every, out_dir, warmup, lr, quant_lr, alpha, seed,
                   max_grad_norm, resume, windows, sources) -> int:
    """Refuse `run_qat`'s options that are wrong alone or together, before the model is looked at (batch_size=0 was
    torch.stack's error, save_every=0 a ZeroDivisionError, seq_len=1 windows without a target a loss of NaN said as
    "lower lr"). Returns ``seed`` as an int (`checked_seed`)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    for name, value, least in (("steps", steps, 1), ("seq_len", seq_len, 2), ("batch_size", batch_size, 1)):
        check_count(name, value, least)  # rank's: `check_rank`
    if save_every is not None:
        check_count("save_every", save_every, 1)
        if out_dir is None:  # it saved nothing, without a word
            raise ValueError(f"save_every={save_every} sets how often the state goes to out_dir, and no out_dir was "
                             "given: drop save_every, or give out_dir")
    if warmup is not None:
        check_count("warmup", warmup, 0)
    check_learning_rates(lr, quant_lr)
    check_alpha(alpha)
    seed = checked_seed("seed", seed)  # a str or float failed in the data order, the model prepared already
    # clip_grad_norm_ with a negative bound flips every gradient's sign: the run climbed the loss without a word
    check_positive("max_grad_norm", max_grad_norm, "the gradient norm clipped to, e.g. 1.0")
    if resume and out_dir is None:
        raise ValueError("resume=True needs the out_dir the interrupted run wrote to")
    if windows is not None and sources is not None:  # the windows trained, the texts were never read
        raise ValueError("sources names the texts run_qat makes its training windows from, and windows were given: "
                         "drop one")
    return seed


def _checked_seq_len(model: nn.Module, seq_len: int, windows: torch.Tensor | None) -> int:
    """The window length the run trains at: that of the ``windows`` given, which must be ``seq_len``, or ``seq_len``
    clamped to the model's context."""
    # the windows given are checked first: the context's check below reads seq_len as their length, and blamed the
    # default 512 on 32-token windows of a 256-token model
    if windows is not None and (windows.dim() != 2 or windows.shape[0] == 0 or windows.shape[1] != seq_len
                                or windows.dtype != torch.long):
        length = windows.shape[1] if windows.dim() == 2 else seq_len
        hint = f" (windows of {length} tokens: pass seq_len={length})" if length != seq_len else ""
        raise ValueError(f"windows must be token ids [n >= 1, seq_len={seq_len}] (torch.long), got "
                         f"{tuple(windows.shape)} {windows.dtype}{hint}")
    context = getattr(model.config, "max_position_embeddings", None)
    if context is None or seq_len <= context:
        return seq_len
    # clamped as `nibble eval` clamps perplexity's seq_len: windows past the context train positions the model never
    # learned, at a quadratic cost (SmolLM2 at --seq-len 100000: one step ran over 170 s on a CPU)
    if windows is not None:
        raise ValueError(f"windows of seq_len={seq_len} exceed the model's context ({context} = "
                         "config.max_position_embeddings): cut them to at most that")
    warn(f"seq_len={seq_len} exceeds the model's context ({context} = config.max_position_embeddings); using "
         f"{context}.")
    return context


def _training_data(model: nn.Module, tokenizer, seq_len: int, batch_size: int, windows: torch.Tensor | None, sources):
    """(windows, sources, batch_size) of the run: the windows given (sources None), or those of ``sources`` (default
    `DEFAULT_SOURCES`), and the batch size, at most the number of windows."""
    if windows is None:  # (sources with windows were refused: `_check_options`)
        sources = training_sources(DEFAULT_SOURCES if sources is None else sources)
        if tokenizer is None:  # was None's AttributeError
            raise ValueError("run_qat needs a tokenizer to make its training windows from sources, or windows (token "
                             "ids [n, seq_len])")
        windows = training_windows(tokenizer, seq_len, sources)
    check_token_ids(model, windows, "the training windows'", "make them with this model's tokenizer")
    if batch_size > windows.shape[0]:
        # a larger batch holds windows twice in one step (`batch_indices`), at the memory of the batch asked: a huge
        # one drew a permutation of the windows for each row, then ran out of memory
        warn(f"batch_size={batch_size} exceeds the {windows.shape[0]} training windows (of seq_len={seq_len} "
             f"tokens); using {windows.shape[0]}, each window once a step.")
        batch_size = windows.shape[0]
    return windows, sources, batch_size


def _gptq_calibration(model: nn.Module, tokenizer, calibration: torch.Tensor | None) -> torch.Tensor:
    """init='gptq''s calibration token ids: those given, or `calibration_for`'s (what `nibble quantize` uses), refused
    as `quantize_model` refuses them, before the state is read or the model changed."""
    if calibration is None:
        if tokenizer is None:
            raise ValueError("init='gptq' needs calibration token ids, or a tokenizer to make them from the C4 "
                             "excerpt")
        from nibble.quantize.calibration import calibration_for
        calibration = calibration_for(GPTQ_START, tokenizer, model)
    check_calibration_ids(model, calibration)
    return calibration


def _resumed_state(path: Path, settings: dict) -> dict | None:
    """The state at ``path`` that a resumed run of ``settings`` goes on from (`read_state`); where there is none, the
    run starts from step 0, with a warning."""
    if path.exists():
        return read_state(path, settings)
    warn(f"resume: no saved state at {path}; starting from step 0")
    return None


def _checked_run(model: nn.Module, tokenizer, recipe: str, steps: int, lr: float, seq_len: int, batch_size: int,
                 out_dir, resume: bool, device, *, objective: str, rank: int, alpha: float | None,
                 quant_lr: float | None, warmup: int | None, save_every: int | None, seed: int, rotation_seed: int,
                 sources, windows: torch.Tensor | None, init: str, calibration, max_grad_norm: float) -> _Run:
    """`run_qat`'s arguments checked and resolved: all it refuses or warns of is said here, before the model is
    changed, and a resume with other settings before the GPTQ start (minutes on a CPU)."""
    seed = _check_options(objective, steps, seq_len, batch_size, save_every, out_dir, warmup, lr, quant_lr, alpha,
                          seed, max_grad_norm, resume, windows, sources)
    check_recipe(recipe, init, rotation_seed, calibration)  # before any calibration text is tokenized
    quant_lr = checked_quant_lr(recipe, quant_lr)
    check_model(model, recipe, init, rotation_seed, rank)
    if out_dir is not None:
        # the folder the export writes: one holding a float model was refused by the export alone, after the training
        out_dir = checkpoint_dir(out_dir, model)
        if not resume:
            check_new_run(out_dir)
    seq_len = _checked_seq_len(model, seq_len, windows)
    device = resolve_device(device)
    windows, sources, batch_size = _training_data(model, tokenizer, seq_len, batch_size, windows, sources)
    if init == "gptq":
        calibration = _gptq_calibration(model, tokenizer, calibration)
    settings = dict(qat_description(recipe, init, rank, alpha, rotation_seed), model=model_record(model),
                    seq_len=seq_len, batch_size=batch_size, seed=seed, objective=objective, steps=steps, lr=lr,
                    quant_lr=quant_lr, warmup=warmup, max_grad_norm=max_grad_norm, sources=sources,
                    windows=token_record(windows), calibration=token_record(calibration) if init == "gptq" else None)
    path = state_path(out_dir) if out_dir is not None else None
    state = _resumed_state(path, settings) if resume else None
    return _Run(recipe=recipe, steps=steps, lr=lr, quant_lr=quant_lr,
                warmup=max(1, steps // 20) if warmup is None else warmup, objective=objective,
                max_grad_norm=max_grad_norm, seed=seed, seq_len=seq_len, batch_size=batch_size, windows=windows,
                calibration=calibration, device=device,
                save_every=DEFAULT_SAVE_EVERY if save_every is None else save_every, path=path, settings=settings,
                state=state, saved_step=None if state is None else state["step"])


def _training_state(model, run: _Run) -> tuple:
    """(optimizer, scheduler, the step to run next, the losses so far): new, or restored from the state ``run``
    resumes (`restore_state`). AdamW; the schedule warms up, then decays (`lr_factor`)."""
    optimizer = torch.optim.AdamW(_param_groups(model, run.lr, run.quant_lr), betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, run.steps, run.warmup))
    if run.state is None:
        return optimizer, scheduler, 0, _LossRecord({})
    start, losses = restore_state(run.state, run.path, model, optimizer, scheduler)
    # the restored optimizer holds the rate of the saved schedule's last step (0 at the end of a finished run): set
    # this schedule's for the step to come (the same where steps did not change)
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = base * lr_factor(start, run.steps, run.warmup)
    return optimizer, scheduler, start, _LossRecord(losses)


def _train_step(model, optimizer, scheduler, ids: torch.Tensor, run: _Run) -> tuple[float, bool]:
    """One optimizer step on the batch ``ids``: its loss, and whether that and every trained parameter as the step
    left them are finite."""
    teacher = None
    if run.objective != "ce":  # the 16-bit model: the same one, its adapters and fake quantization off
        with (torch.no_grad(), model.disable_adapter(), quantization_disabled(model), _autocast(run.device)):
            teacher = model(input_ids=ids, use_cache=False).logits
    with _autocast(run.device):
        logits = model(input_ids=ids, use_cache=False).logits
    loss = qat_loss(logits, ids, teacher, run.objective)
    del logits, teacher
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    trained = [p for g in optimizer.param_groups for p in g["params"]]
    torch.nn.utils.clip_grad_norm_(trained, run.max_grad_norm)
    optimizer.step()
    scheduler.step()
    # the parameters as this step left them, not only the loss computed before it: a last step's NaN update was
    # exported as an all-NaN model (one sync a step, with the loss's)
    updated_finite = torch.stack([torch.isfinite(p).all() for p in trained])
    value = loss.item()
    return value, math.isfinite(value) and bool(updated_finite.all())


def _diverged(run: _Run, step: int, loss: float) -> FloatingPointError:
    """The error of a run whose ``step`` (counted from 1, as the bar, the callback and the saved state count) made
    its ``loss`` or a trained parameter NaN or Inf."""
    what = f"loss became {loss}" if not math.isfinite(loss) else "trained parameters became NaN or Inf"
    # the lower rates cannot go on from the state this run saved (a resume at other rates is refused, a new run into
    # its folder too)
    kept = "" if run.saved_step is None else (
        f" in another folder, or delete {run.path.parent} first: {run.path} holds this run at step {run.saved_step}, "
        "which resume=True goes on from at these rates only")
    rates = "lr / quant_lr" if run.quant_lr is not None else "lr"
    return FloatingPointError(f"PE-QAT {what} at step {step}; lower {rates}{kept}")


def _train(model, optimizer, scheduler, start: int, losses: _LossRecord, run: _Run, progress: bool, callback) -> None:
    """The steps from ``start`` (0, or the resumed state's) to ``run.steps``, on batches of the windows in their
    seeded order (`batch_indices`). The state goes to ``run.path`` every ``save_every`` steps and after the last,
    each save before that step's ``callback``."""
    model.train()
    bar = tqdm(range(start, run.steps), initial=start, total=run.steps, desc=f"PE-QAT {run.recipe}",
               disable=not progress, unit="step")
    for step in bar:
        ids = run.windows[batch_indices(step, run.batch_size, run.windows.shape[0], run.seed)].to(run.device)
        loss, finite = _train_step(model, optimizer, scheduler, ids, run)
        done = step + 1
        if not finite:
            raise _diverged(run, done, loss)
        losses.add(loss)
        bar.set_postfix({"loss": f"{loss:.4f}", f"last{FINAL_LOSS_STEPS}": f"{statistics.fmean(losses.recent):.4f}",
                         "lr": f"{scheduler.get_last_lr()[0]:.2e}"})
        if run.path is not None and (done % run.save_every == 0 or done == run.steps):
            save_state(run.path, model, optimizer, scheduler, done, run.settings, losses.saved())
            run.saved_step = done
        if callback is not None:
            callback(done, loss)
    bar.close()


def run_qat(model: nn.Module, tokenizer, recipe: str, steps: int, lr: float = 1e-3, seq_len: int = 512,
            batch_size: int = 8, out_dir=None, resume: bool = False, device=None, *, objective: str = "kl",
            rank: int = 16, alpha: float | None = None, quant_lr: float | None = None, warmup: int | None = None,
            save_every: int | None = None, seed: int = 0, rotation_seed: int = 0, sources=None,
            windows: torch.Tensor | None = None, init: str = "rtn", calibration=None,
            gradient_checkpointing: bool = True, max_grad_norm: float = 1.0, progress: bool = True,
            callback=None) -> nn.Module:
    """Train ``model`` (a float HF causal LM, modified in place) with PE-QAT; returns the PeftModel.

    The model is cast to float32, the training's master weights (a bfloat16 or float16 model given comes back in
    float32), so `export` writes its 16-bit tensors (embeddings, norms, lm_head) in float32, as a model quantized on
    the CPU is saved; `nibble.load_quantized` reads them in bf16 on a GPU all the same.

    ``steps`` optimizer steps of ``batch_size`` windows of ``seq_len`` tokens from ``sources`` (the names or paths
    `nibble.quantize.calibration.calibration_text` takes, or one of them; default `DEFAULT_SOURCES`), or of the given
    ``windows`` LongTensor [n, seq_len] (not both). ``lr`` is the LoRA learning rate, ``quant_lr`` that of the
    clip/smoothing parameters the per-token and per-channel recipes learn (default `DEFAULT_QUANT_LR`; the hadamard
    recipe learns none: one given is warned of, and the run records None). ``init="gptq"`` starts from GPTQ's weights
    (module doc), calibrated on ``calibration`` (default: `calibration_for`'s, what `nibble quantize` uses: 128 windows
    of 512 tokens of the C4 excerpt, or of the model's context where that is shorter; windows past it are refused, too
    few tokens warned of, as `quantize_model` does: `architecture.check_calibration`); it keeps a float32 start weight
    beside every frozen weight (twice the linears' memory), and a resumed run computes them again. ``out_dir``
    (optional) receives the resumable state every ``save_every`` steps (default `DEFAULT_SAVE_EVERY`; given without
    ``out_dir``, refused); ``resume=True`` continues from it, and without it an ``out_dir`` that holds a run's state is
    refused (`check_new_run`), as is one that holds a model the export could not replace
    (`checkpoint_files.checkpoint_dir`: a float model, the one trained above all). ``callback(step, loss)`` runs after
    each step (and after that step's state is saved). ``rank`` is LoRA's, at most the largest min(in_features,
    out_features) of the linears (`check_rank`); a ``batch_size`` past the training windows is clamped to them, with a
    warning. The model comes back in eval mode, on ``device``, its ``config.use_cache`` as it was given, with
    ``qat_meta`` describing the run (its settings, the tokens it trained on, ``first_loss``: step 1's, ``final_loss``:
    the mean of the last ``final_loss_steps`` steps' losses, `FINAL_LOSS_STEPS` but in a shorter run); `export` turns it
    into the W4A4 checkpoint (peft's ``merge_and_unload`` gives the trained fake-quant model; ``save_pretrained`` of
    either is refused, `SAVE_REFUSED`). With ``out_dir``, a finished run called again with the same arguments and
    ``resume=True`` trains nothing and returns the trained model: how it is loaded back.
    """
    run = _checked_run(model, tokenizer, recipe, steps, lr, seq_len, batch_size, out_dir, resume, device,
                       objective=objective, rank=rank, alpha=alpha, quant_lr=quant_lr, warmup=warmup,
                       save_every=save_every, seed=seed, rotation_seed=rotation_seed, sources=sources, windows=windows,
                       init=init, calibration=calibration, max_grad_norm=max_grad_norm)
    try:
        torch.manual_seed(run.seed)  # LoRA's initialization (the data order and the rotation draw from their own)
        model = model.to(device=run.device, dtype=torch.float32)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        peft_model = prepare_qat_model(model, recipe, rank, alpha, rotation_seed, init, run.calibration, progress)
        optimizer, scheduler, start, losses = _training_state(peft_model, run)
        t0 = time.time()
        _train(peft_model, optimizer, scheduler, start, losses, run, progress, callback)
    except KeyboardInterrupt:  # Ctrl-C: which state on disk is this run's, which the caller cannot tell
        raise QatInterrupted(run.path, run.saved_step, min(run.save_every, steps)) from None
    if gradient_checkpointing:
        peft_model.get_base_model().gradient_checkpointing_disable()
    peft_model.eval()
    tokens_a_step = run.batch_size * run.seq_len
    peft_model.get_base_model().qat_meta = dict(
        run.settings, tokens_this_run=(steps - start) * tokens_a_step, seconds_this_run=round(time.time() - t0, 1),
        tokens_total=steps * tokens_a_step, **losses.meta())
    return peft_model
