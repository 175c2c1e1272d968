import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def skip_without_cuda_kernel(reason: str):
    """Skip a test whose CUDA C++ kernel cannot run here (no nvcc, an older GPU). Not on Hopper with
    the CUDA kernels on: nvcc belongs to that setup, and a kernel that failed to build must fail the
    suite (nibble warned why), not hide behind a skip. NIBBLE_CUDA_KERNELS=0 tests without them."""
    if (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
            and os.environ.get("NIBBLE_CUDA_KERNELS", "1") != "0"):
        pytest.fail(f"{reason}: on an sm_90+ GPU the CUDA kernels must build (see nibble's warning: nvcc "
                    f"missing or a compile error); NIBBLE_CUDA_KERNELS=0 runs the suite without them")
    pytest.skip(reason)


def tiny_config(arch: str = "llama", **overrides):
    """A small random causal-LM config of one of the supported families (sizes multiple of 32)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[arch]
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=arch != "mistral")
    if arch == "qwen3":  # heads wider than hidden_size / heads, as Qwen3's own (q_proj 64 -> 128)
        kw["head_dim"] = 32
    kw.update(overrides)
    return cls(**kw)


def tiny_model(arch: str = "llama", dtype=torch.float32, **overrides):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=dtype).eval()


def tiny_tokenizer(chat_template=None):
    """A three-word transformers tokenizer, built in memory (no download): for the saves that write one."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", chat_template=chat_template)


def random_canonical(K, N, G, symmetric, seed=0, min_zp=0):
    """A random canonical Int4Weight [N, K] of groups of G: integer zero points in [min_zp, 15] (8 where
    ``symmetric``), fp16 scales, as AutoAWQ / GPTQ checkpoints hold them."""
    from nibble.formats.int4 import Int4Weight

    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    s = (torch.rand(N, K // G, generator=gen) * 0.05 + 1e-3).half().float()
    zp = torch.full_like(s, 8) if symmetric else torch.randint(min_zp, 16, s.shape, generator=gen).float()
    return Int4Weight.from_codes(codes, s, (-zp * s).half().float(), G)


def fake_cuda(mode, *tensors) -> list:
    """``tensors`` as fake CUDA tensors of FakeTensorMode ``mode``: the ops' GPU paths traced without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensor
    return [FakeTensor(mode, t.to("meta"), torch.device("cuda", 0)) for t in tensors]


# Before torch 2.10, FakeTensorMode moved the reference's constants to a fake CUDA device through the CUDA driver
# (torch.__version__ is a TorchVersion: it compares as a version, "2.9" < "2.10").
reference_on_fake_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() and torch.__version__ < "2.10",
    reason="before torch 2.10 the reference on fake CUDA tensors needs the CUDA driver")


def assert_unchanged_by_edits(weight, tensors):
    """In-place edits of each of ``tensors`` leave the Int4Weight ``weight`` as it was: they share no memory."""
    kept = {name: getattr(weight, name).clone() for name in ("qweight", "scales", "zeros")}
    for tensor in tensors:
        tensor.add_(1)
    for name, before in kept.items():
        assert torch.equal(getattr(weight, name), before), name


def past_stop(tokens: torch.Tensor, stops) -> torch.Tensor:
    """``tokens`` [B, n] with each row's tokens after its first stop token replaced by it: what the engine returns
    for a sequence that stopped while others ran on."""
    out = tokens.clone()
    for row in out:
        ends = [i for i, t in enumerate(row.tolist()) if t in stops]
        if ends:
            row[ends[0]:] = row[ends[0]]
    return out


def poison_new_tensors(monkeypatch, cpu: bool = False):
    """Make every tensor torch.empty / empty_like hand out (on CUDA; on the CPU too with ``cpu``: the Triton
    interpreter's runs) hold garbage: NaN, True, or the type's largest integer (never a code, scale, index or sum
    a kernel writes; the largest key of a greedy draw), so an output element a kernel leaves unwritten cannot
    look right. (Fresh CPU memory is mostly zeros, and a CUDA block reused from a previous call of the same
    kernel holds the same answer.) What torch.compile makes while it compiles is left alone: fake tensors hold
    no memory, and leaves that require grad refuse in-place fills."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t):
        if (type(t) is torch.Tensor and (t.is_cuda or cpu and t.device.type == "cpu") and t.numel()
                and not t.requires_grad):
            if t.dtype == torch.bool:
                t.fill_(True)
            elif t.is_floating_point() or t.is_complex():
                t.fill_(float("nan"))
            else:
                t.fill_(torch.iinfo(t.dtype).max)
        return t
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poisoned(real_empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poisoned(real_empty_like(*args, **kwargs)))
