"""Import of AutoAWQ-GEMM / GPTQ checkpoints and export to them.

The checkpoints are written here by small writers that follow the published formats (AutoAWQ's
WQLinear_GEMM.from_linear packing; AutoGPTQ's QuantLinear.pack with v1 "zp - 1" zeros; GPTQ act-order
g_idx), independently of nibble's converters; nibble's import must reproduce their dequantized
weights and the logits of a float model holding those weights.
"""
import json
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import tiny_model
from nibble import Engine, QuantConfig, load_quantized, quantize_model, save_quantized
from nibble.kernels.reference import dequantize
from nibble.models.hf_import import (UnsupportedCheckpointError, export_awq, export_gptq, fold_mlp_input_orders,
                                     load_hf_quantized)
from nibble.nn.quant_linear import PermutedInputQuantLinear, QuantLinear, shared_input_forward, shared_input_perm

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def _int32(words):
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def minmax_quantize(W, G, sym, order=None):
    """Asymmetric (or symmetric, zp = 8) min-max quantization, groups formed along ``order`` of the inputs.

    Returns int codes q [N, K], zp [N, K/G], fp16 scales [N, K/G], g_idx [K] (original input order)."""
    N, K = W.shape
    order = torch.arange(K) if order is None else order
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[order] = (torch.arange(K) // G).to(torch.int32)
    Wo = W[:, order].reshape(N, K // G, G)
    if sym:
        s = (Wo.abs().amax(-1) / 7).clamp(min=1e-5).half()
        zp = torch.full_like(s, 8, dtype=torch.int64)
    else:
        mx, mn = Wo.amax(-1).clamp(min=0), Wo.amin(-1).clamp(max=0)
        s = ((mx - mn).clamp(min=1e-5) / 15).half()
        zp = torch.clamp(torch.round(-mn / s.float()), 1, 15).long()  # >= 1: v1 stores zp - 1 nibble-wise
    sk, zk = s.float()[:, g_idx.long()], zp[:, g_idx.long()]
    q = torch.clamp(torch.round(W / sk) + zk, 0, 15).long()
    return q, zp, s, g_idx


def write_awq_linear(W, G):
    """AutoAWQ WQLinear_GEMM.from_linear: qweight [K, N/8] with nibble i of word c = column 8c + ORDER[i]."""
    q, zp, s, _ = minmax_quantize(W, G, sym=False)
    N, K = W.shape
    intweight, zeros = q.t(), zp.t()  # [K, N], [K/G, N]
    qweight = torch.zeros(K, N // 8, dtype=torch.int64)
    qzeros = torch.zeros(K // G, N // 8, dtype=torch.int64)
    for col in range(N // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + AWQ_ORDER[i]] << (4 * i)
            qzeros[:, col] |= zeros[:, col * 8 + AWQ_ORDER[i]] << (4 * i)
    dense = ((q - zp.repeat_interleave(G, 1)) * s.float().repeat_interleave(G, 1)).float()  # (q - zp) * s
    return {"qweight": _int32(qweight), "qzeros": _int32(qzeros), "scales": s.t().contiguous()}, dense


def write_gptq_linear(W, G, sym, desc_act, fmt="gptq", order=None):
    """AutoGPTQ QuantLinear.pack: qweight [K/8, N] row 8i+j in bits 4j; qzeros [K/G, N/8] col 8c+j in bits 4j
    holding zp - 1 (v1) or zp (v2); g_idx; act-order groups follow a processing order (``order``, else random)."""
    N, K = W.shape
    order = (torch.randperm(K) if order is None else order) if desc_act else None
    q, zp, s, g_idx = minmax_quantize(W, G, sym, order)
    intweight = q.t()  # [K, N]
    qweight = torch.zeros(K // 8, N, dtype=torch.int64)
    for row in range(K // 8):
        for j in range(8):
            qweight[row] |= intweight[8 * row + j] << (4 * j)
    zeros = zp.t() - (1 if fmt == "gptq" else 0)  # [K/G, N]
    qzeros = torch.zeros(K // G, N // 8, dtype=torch.int64)
    for col in range(N // 8):
        for j in range(8):
            qzeros[:, col] |= zeros[:, 8 * col + j] << (4 * j)
    dense = ((q - zp[:, g_idx.long()]) * s.float()[:, g_idx.long()]).float()
    tensors = {"qweight": _int32(qweight), "qzeros": _int32(qzeros), "scales": s.t().contiguous(), "g_idx": g_idx}
    return tensors, dense


def write_checkpoint(path, model, quantization_config, write_linear, sharded=False):
    """A tiny HF checkpoint: quantized linears via ``write_linear``, everything else fp16 (as AutoAWQ/GPTQ save).

    Returns the float reference model: same architecture, the writer's dequantized weights."""
    path.mkdir(parents=True, exist_ok=True)
    tensors, dense = {}, {}
    for i, _ in enumerate(model.model.layers):
        for name in LINEARS:
            prefix = f"model.layers.{i}.{name}"
            t, d = write_linear(model.get_submodule(prefix).weight.detach().float())
            tensors.update({f"{prefix}.{k}": v for k, v in t.items()})
            dense[prefix] = d
    for k, v in model.state_dict().items():
        quantized = k.endswith(".weight") and k.rpartition(".")[0] in dense
        if not quantized and not (k == "lm_head.weight" and model.config.tie_word_embeddings):
            tensors[k] = v.half().contiguous()
    if sharded:  # two shards + index, as large checkpoints are saved
        keys = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
        for fname, ks in shards.items():
            save_file({k: tensors[k] for k in ks}, str(path / fname), metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(cfg, default=str))
    ref = tiny_model(model.config.model_type)
    with torch.no_grad():
        for k, p in ref.state_dict().items():
            if k.endswith(".weight") and k.rpartition(".")[0] in dense:
                p.copy_(dense[k.rpartition(".")[0]])
            else:
                p.copy_(model.state_dict()[k].half().float())
    return ref, dense


def original_order_weight(layer: QuantLinear) -> torch.Tensor:
    w = dequantize(layer.qweight, layer.scales, layer.zeros, layer.group_size).double()
    if isinstance(layer, PermutedInputQuantLinear):
        w = w[:, torch.argsort(layer.input_perm)]
    return w


def down_proj_orders(path) -> dict:
    """{"model.layers.i.mlp": down_proj's stored input order} of an act-order checkpoint: the order the
    import moves into gate_proj's and up_proj's output channels (`fold_mlp_input_orders`)."""
    tensors = load_file(str(path / "model.safetensors"))
    return {k[: -len(".down_proj.g_idx")]: torch.argsort(v.long(), stable=True)
            for k, v in tensors.items() if k.endswith("mlp.down_proj.g_idx")}


def check_import(model, dense, ref, ids, down_orders=None):
    down_orders = down_orders or {}
    for prefix, d in dense.items():
        layer = model.get_submodule(prefix)
        assert isinstance(layer, QuantLinear)
        parent, _, child = prefix.rpartition(".")
        if child == "down_proj":
            assert not isinstance(layer, PermutedInputQuantLinear), prefix  # its order moved into gate / up
            if parent in down_orders:
                d = d[:, down_orders[parent]]  # its inputs in stored order
        elif parent in down_orders and child in ("gate_proj", "up_proj"):
            d = d[down_orders[parent]]  # their outputs in down_proj's stored order
        # the only difference: the canonical offset z = fp16(-zp*s), at most 2^-11 * 15 * s away
        bound = d.abs().max().double() * 15 * 2.0 ** -11 + 1e-7
        assert (original_order_weight(layer) - d.double()).abs().max() <= bound, prefix
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()


@pytest.mark.parametrize("arch,G", [("llama", 32), ("qwen2", 64), ("qwen3", 32)])
def test_autoawq_gemm_checkpoint_imports_without_requantization(tmp_path, arch, G):
    model = tiny_model(arch)
    qc = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": G, "zero_point": True}
    ref, dense = write_checkpoint(tmp_path, model, qc, lambda W: write_awq_linear(W, G), sharded=arch == "qwen2")
    loaded, tok = load_hf_quantized(tmp_path)
    assert tok is None and loaded.config.quantization_config["method"] == "awq"
    check_import(loaded, dense, ref, torch.randint(0, 256, (2, 16)))
    # ...and export_awq writes back the very same tensors
    export_awq(loaded, tmp_path / "again")
    a = {}
    for f in tmp_path.glob("*.safetensors"):
        a.update(load_file(str(f)))
    b = load_file(str(tmp_path / "again" / "model.safetensors"))
    for k in a:
        if k.endswith(("qweight", "qzeros", "scales")):
            assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("sym,desc_act,fmt", [(True, False, "gptq"), (False, False, "gptq"), (False, True, "gptq"),
                                              (True, True, "gptq_v2")])
def test_gptq_checkpoint_imports_without_requantization(tmp_path, sym, desc_act, fmt):
    G = 32
    model = tiny_model("llama")
    qc = {"quant_method": "gptq", "bits": 4, "group_size": G, "sym": sym, "desc_act": desc_act,
          "checkpoint_format": fmt}
    ref, dense = write_checkpoint(tmp_path, model, qc, lambda W: write_gptq_linear(W, G, sym, desc_act, fmt))
    loaded, _ = load_hf_quantized(tmp_path)
    permuted = [n for n, m in loaded.named_modules() if isinstance(m, PermutedInputQuantLinear)]
    assert len(permuted) == (12 if desc_act else 0)  # 2 layers x 6: down_proj's order is folded
    assert set(loaded.config.quantization_config["input_permuted_modules"]) == set(permuted)
    ids = torch.randint(0, 256, (2, 16))
    check_import(loaded, dense, ref, ids, down_proj_orders(tmp_path) if desc_act else None)
    export_gptq(loaded, tmp_path / "again", checkpoint_format=fmt)
    assert_same_gptq_model(tmp_path, tmp_path / "again", loaded, ids)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]["desc_act"] == desc_act


def test_gptq_zero_point_labels_are_read_as_transformers_and_vllm_read_them(tmp_path):
    """transformers' GPTQConfig names the convention `format` (nibble read only `checkpoint_format`: a v2 file was
    read as v1, every zero point one high); a symmetric file labelled v1 that stores v2's 8 (GPTQModel v5 wrote such)
    ran every weight a step off; other zero points under sym=true are a config that does not describe the tensors."""
    G, ids = 32, torch.randint(0, 256, (2, 16))
    model = tiny_model("llama")

    def load(name, qc, sym, fmt):
        torch.manual_seed(0)
        ref, dense = write_checkpoint(tmp_path / name, model, {"quant_method": "gptq", "bits": 4, "group_size": G,
                                                               "desc_act": False, **qc},
                                      lambda W: write_gptq_linear(W, G, sym, False, fmt))
        return ref, dense, tmp_path / name

    ref, dense, path = load("format-key", {"sym": False, "format": "gptq_v2"}, False, "gptq_v2")
    check_import(load_hf_quantized(path)[0], dense, ref, ids)
    ref, dense, path = load("mislabelled", {"sym": True, "checkpoint_format": "gptq"}, True, "gptq_v2")
    with pytest.warns(UserWarning, match=r"but 14 of its layers \(model.layers.0.mlp.down_proj, ...\) store 8, the "
                                         "gptq_v2 convention: read as gptq_v2"):
        check_import(load_hf_quantized(path)[0], dense, ref, ids)
    _, _, path = load("not-symmetric", {"sym": True, "checkpoint_format": "gptq"}, False, "gptq")
    with pytest.raises(ValueError, match=r"down_proj: cannot read .*says sym=true, whose zero points are all 8 .* qzeros hold"):
        load_hf_quantized(path)
    # a config that does not say sym (GPTQ's default is symmetric) loads as its zeros are, and is recorded so
    ref, dense, path = load("unsaid", {"checkpoint_format": "gptq"}, False, "gptq")
    unsaid = load_hf_quantized(path)[0]
    check_import(unsaid, dense, ref, ids)
    assert unsaid.config.quantization_config["symmetric"] is False
    _, _, path = load("disagree", {"sym": False, "checkpoint_format": "gptq", "format": "gptq_v2"}, False, "gptq")
    with pytest.raises(UnsupportedCheckpointError, match="make the two agree"):
        load_hf_quantized(path)


def assert_same_gptq_model(original, exported, model, ids):
    """An exported import holds the original GPTQ tensors, but for the MLPs of act-order layers, whose
    down_proj order the import folded into gate_proj / up_proj: those hold the same model (logits equal)."""
    a, b = (load_file(str(d / "model.safetensors")) for d in (original, exported))
    folded = {k[: -len(".down_proj.g_idx")] for k, v in b.items()
              if k.endswith("mlp.down_proj.g_idx") and not torch.equal(v, a[k])}
    for k in a:
        if k.endswith(("qweight", "qzeros", "scales", "g_idx")) and not k.startswith(tuple(folded)):
            assert torch.equal(a[k], b[k]), k
    again, _ = load_hf_quantized(exported)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def _fp16_exact(model):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


@pytest.mark.parametrize("symmetric", [False, True])
def test_export_awq_then_import_gives_identical_logits(tmp_path, symmetric):
    model = _fp16_exact(tiny_model("llama"))
    quantize_model(model, QuantConfig(group_size=32, symmetric=symmetric), progress=False)
    export_awq(model, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "awq" and qc["version"] == "gemm" and qc["bits"] == 4
    assert qc["group_size"] == 32 and qc["zero_point"] is True
    tensors = load_file(str(tmp_path / "model.safetensors"))
    q = tensors["model.layers.0.mlp.down_proj.qweight"]
    assert q.dtype == torch.int32 and q.shape == (192, 64 // 8)  # [K, N/8]: packed along N
    loaded, _ = load_hf_quantized(tmp_path)
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            other = loaded.get_submodule(name)
            for b in ("qweight", "scales", "zeros"):
                assert torch.equal(getattr(m, b), getattr(other, b)), (name, b)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_export_refuses_what_awq_cannot_hold(tmp_path):
    model = tiny_model("llama")
    quantize_model(model, QuantConfig(group_size=32, zero_point="float"), progress=False)
    for export in (export_awq, export_gptq):  # the layer named, whichever GPTQ format is chosen
        with pytest.raises(ValueError, match=r"^model\.layers\.0\.\S+: this weight has float zero points"):
            export(model, tmp_path / "f")
    model = tiny_model("llama")
    quantize_model(model, QuantConfig(mode="w4a4"), progress=False)
    with pytest.raises(ValueError, match="only W4A16"):
        export_awq(model, tmp_path / "w4a4")
    model = tiny_model("llama")  # rotated: told the mode first, not to quantize an unrotated model, still W4A4
    quantize_model(model, QuantConfig(mode="w4a4", rotation="hadamard"), progress=False)
    with pytest.raises(ValueError, match="only W4A16"):
        export_gptq(model, tmp_path / "w4a4-hadamard")
    model = tiny_model("llama")
    quantize_model(model, QuantConfig(group_size=32, modules_to_not_convert=[]), progress=False)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.zeros[0, 0] = 0.0  # a zero point of 0: GPTQ would choose v2
    for export in (export_awq, export_gptq):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # refused before any "written as gptq_v2"
            with pytest.raises(ValueError, match="lm_head is quantized.*modules_to_not_convert=\\['lm_head'\\]"):
                export(model, tmp_path / "head")


def test_a_direct_export_refuses_its_folder_before_it_warns_about_the_model(tmp_path):
    """export_gptq called directly said "written as checkpoint_format 'gptq_v2'" of a model with a zero point of 0, then
    refused the folder, which nothing was written to (save_quantized checked the folder first)."""
    model = tiny_model("llama")
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.zeros[0, 0] = 0.0  # a zero point of 0: GPTQ would choose v2, said
    (tmp_path / "file").write_text("")
    for export in (export_awq, export_gptq):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match="file is a file: a checkpoint is a folder"):
                export(model, tmp_path / "file")


def test_export_refuses_a_rotated_model_whose_16_bit_down_proj_rotates_its_input(tmp_path):
    """A rotated W4A16 model keeps its down_projs in 16 bits with their online Hadamard: the export wrote each as a
    plain linear, which every reader (nibble's importer too) ran on the unrotated input, logits 0.2 apart."""
    model = tiny_model("llama")
    quantize_model(model, QuantConfig(group_size=32, rotation="hadamard", modules_to_not_convert=["lm_head", "down_proj"]),
                   progress=False)
    for export in (export_awq, export_gptq):
        with pytest.raises(ValueError, match=r"^model\.layers\.0\.mlp\.down_proj rotates its input online .* save "
                                             r"the model in nibble's format"):
            export(model, tmp_path / export.__name__)
        assert not (tmp_path / export.__name__ / "config.json").exists()


@pytest.mark.parametrize("tensor", ["model.layers.0.self_attn.k_proj.bias", "model.norm.weight"])  # quantized, kept
def test_export_refuses_a_16_bit_value_float16_cannot_hold_before_writing(tmp_path, tensor):
    """The export cast every 16-bit tensor to float16: a bfloat16 value beyond its range (a Qwen-style q/k/v bias
    above all) was written as Inf, which AutoAWQ and vLLM ran, and nibble's loader called a corrupt checkpoint."""
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    with torch.no_grad():
        model.get_parameter(tensor)[0] = 1e5
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    for fmt in ("awq", "gptq"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # refused before any "written as gptq_v2"
            with pytest.raises(ValueError, match=rf"^{re.escape(tensor)} holds 1 value\(s\) beyond float16's range "
                                                 rf"\(e\.g\. 99840\), and {fmt} checkpoints keep their 16-bit tensors "
                                                 r"in float16, .* save the model in nibble's format"):
                save_quantized(model, tmp_path / fmt, format=fmt)
        assert not (tmp_path / fmt).exists()


def test_export_reads_the_float16_range_once_and_writes_a_tiny_16_bit_value_as_float16_rounds_it(tmp_path,
                                                                                                      monkeypatch):
    """export_gptq took `_exportable_linears` twice (and with it a float16 cast of every tensor of the model). A value
    below float16's range in a norm weight is written as float16 rounds it (0 here), not refused; the scales, where 0
    would be wrong, are float16 in the model already and written as they are."""
    import nibble.models.hf_import as hf_import
    model = tiny_model("llama", dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.norm.weight[0] = 1e-9  # below float16's smallest subnormal, 6e-8
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    checked, check = [], hf_import._check_float16_range
    monkeypatch.setattr(hf_import, "_check_float16_range", lambda *args: checked.append(1) or check(*args))
    for export in (export_awq, export_gptq):
        checked.clear()
        export(model, tmp_path / export.__name__)
        assert len(checked) == 1, export.__name__
        written = load_file(tmp_path / export.__name__ / "model.safetensors")
        assert written["model.norm.weight"][0] == 0
        assert torch.equal(written["model.layers.0.self_attn.q_proj.scales"],
                           model.model.layers[0].self_attn.q_proj.scales)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "bitsandbytes", "bits": 4}, "quant_method='bitsandbytes' is not supported"),
    ({"quant_method": "awq", "version": "gemv", "bits": 4, "group_size": 32}, "version='gemv' is not supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 32}, "bits=8 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    (None, "no quantization_config"),
])
def test_unsupported_checkpoints_are_clear_errors(tmp_path, qc, match):
    cfg = tiny_model("llama").config.to_dict()
    if qc is not None:
        cfg["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(cfg, default=str))
    with pytest.raises(UnsupportedCheckpointError, match=match) as e:
        load_hf_quantized(tmp_path)
    assert "awq" in str(e.value) and "gptq" in str(e.value)  # says what is supported


def _act_order_checkpoint(path, shared: bool):
    """A GPTQ act-order checkpoint of the tiny model. ``shared``: the layers of a block that read the same
    input share one processing order, as GPTQ finds them (one Hessian); else every layer its own."""
    G, orders = 32, {}

    def write(W):
        order = orders.setdefault(W.shape[1], torch.randperm(W.shape[1])) if shared else None
        return write_gptq_linear(W, G, False, True, "gptq", order)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": G, "sym": False, "desc_act": True}
    return write_checkpoint(path, tiny_model("llama"), qc, write)[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("shared", [True, False])
def test_act_order_layers_that_share_an_input_run_together_only_in_one_order(tmp_path, shared, device):
    # The engine runs q/k/v and gate/up through shared_input_forward, one launch a group: layers whose
    # inputs are permuted must see x in their own order there too (they once got x unpermuted).
    ref = _act_order_checkpoint(tmp_path, shared)
    dtype = torch.float32 if device == "cpu" else torch.float16
    model, _ = load_hf_quantized(tmp_path, device=device, dtype=dtype)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert (len({m.input_order for m in (attn.q_proj, attn.k_proj, attn.v_proj)}) == 1) == shared
    for layers in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        for tokens in (1, 5, 40):
            x = torch.randn(1, tokens, 64, device=device, dtype=dtype)
            for got, layer in zip(shared_input_forward(layers, x), layers):
                torch.testing.assert_close(got, layer(x), rtol=1e-3, atol=1e-3)
    ids = torch.randint(0, 256, (1, 19), device=device)
    with torch.no_grad():
        want = ref.to(device)(ids).logits[:, -2:].float()
    engine = Engine(model, max_seq_len=64)
    got = [engine.prefill(ids[:, :-1]).float()]  # the prompt, then one decode step (o_proj: its own path)
    with torch.inference_mode():
        got.append(engine.forward(ids[:, -1:], torch.tensor([18], device=device)).float())
    tol = 1e-3 if device == "cpu" else 2e-2
    for g, w in zip(got, want.unbind(1)):
        assert (g - w).abs().max() <= tol * w.abs().max()


def test_an_act_order_import_saved_by_nibble_loads_back_permuted(tmp_path):
    ref = _act_order_checkpoint(tmp_path / "gptq", shared=True)
    model, _ = load_quantized(tmp_path / "gptq")  # a GPTQ directory loads through the one entry point
    save_quantized(model, tmp_path / "nibble")
    qc = json.loads((tmp_path / "nibble" / "config.json").read_text())["quantization_config"]
    assert len(qc["input_permuted_modules"]) == 12
    again, _ = load_quantized(tmp_path / "nibble")
    # transformers' from_pretrained too (`hf_quantizer`), which fills input_perm without the layer's load hook
    transformers_load = AutoModelForCausalLM.from_pretrained(tmp_path / "nibble")
    for name in qc["input_permuted_modules"]:
        for loaded in (again, transformers_load):
            layer = loaded.get_submodule(name)
            assert isinstance(layer, PermutedInputQuantLinear)
            assert layer.input_order == model.get_submodule(name).input_order
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
        assert torch.equal(transformers_load(ids).logits, model(ids).logits)
        assert (again(ids).logits - ref(ids).logits).abs().max() <= 1e-3 * ref(ids).logits.abs().max()
    save_quantized(again, tmp_path / "gptq-again", format="gptq")  # and back to GPTQ
    assert_same_gptq_model(tmp_path / "gptq", tmp_path / "gptq-again", again, ids)


def test_save_quantized_writes_the_formats_other_tools_read(tmp_path):
    model = tiny_model("llama")
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        want = model(ids).logits
    for fmt in ("awq", "gptq", "gptq_v2"):
        save_quantized(model, tmp_path / fmt, format=fmt)
        written = json.loads((tmp_path / fmt / "config.json").read_text())["quantization_config"]
        method = fmt.removesuffix("_v2")
        assert written["quant_method"] == method
        if method == "gptq":  # the convention under both its names (transformers reads `format`)
            assert written["checkpoint_format"] == written["format"] == fmt
        loaded, _ = load_quantized(tmp_path / fmt)
        with torch.no_grad():  # fp16 scales and non-quantized tensors in those formats: within their rounding
            assert (loaded(ids).logits - want).abs().max() <= 1e-2 * want.abs().max()
        qc = loaded.config.quantization_config  # RTN, said as such (it read back as AWQ / GPTQ-calibrated)
        assert (qc["method"], qc["clip_search"], qc["imported_from"]["quant_method"]) == ("rtn", False, method)
    # a group with no negative weight has zero point 0, which v1 cannot hold: "gptq" writes v2 then, and says so
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.zeros[0, 3] = 0.0
    with pytest.warns(UserWarning, match=r"1 layers \(model.layers.1.mlp.up_proj, ...\) have groups with zero point 0"):
        save_quantized(model, tmp_path / "zp0", format="gptq")
    assert json.loads((tmp_path / "zp0" / "config.json").read_text())["quantization_config"]["format"] == "gptq_v2"
    loaded, _ = load_quantized(tmp_path / "zp0")
    assert torch.equal(loaded.model.layers[1].mlp.up_proj.zeros, model.model.layers[1].mlp.up_proj.zeros)
    with pytest.raises(ValueError, match="up_proj: 1 groups have zero point 0"):
        export_gptq(model, tmp_path / "v1", checkpoint_format="gptq")
    assert not (tmp_path / "v1").exists()
    with pytest.raises(ValueError, match=r"format must be one of \('nibble', 'awq', 'gptq', 'gptq_v2'\)"):
        save_quantized(model, tmp_path / "x", format="exl2")


def test_a_corrupt_input_permutation_is_refused():
    layer = PermutedInputQuantLinear(64, 32, group_size=32)
    perm = torch.arange(64)
    perm[3] = 5  # 5 twice, 3 never: inputs would be dropped silently
    with pytest.raises(ValueError, match="permutation of 0..63"):
        layer.set_input_perm(perm)
    with pytest.raises(ValueError, match="must hold 64 indices"):
        layer.set_input_perm(torch.arange(63))
    assert torch.equal(layer.input_perm, torch.arange(64))  # refused permutations are never taken


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("gate_up", ["int4", "16-bit", "16-bit, biased"])  # biased: their biases move too
def test_down_proj_order_folds_into_gate_and_up(tmp_path, gate_up, device):
    # down_proj's input order moved into gate_proj's and up_proj's output channels: the same model with a
    # gather fewer. A nibble save from before the fold lists permuted down_projs; load_quantized folds them.
    skip = ["lm_head"] + (["mlp.gate_proj", "mlp.up_proj"] if gate_up.startswith("16-bit") else [])
    model = tiny_model("llama", mlp_bias=gate_up.endswith("biased"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    quantize_model(model, QuantConfig(group_size=32, modules_to_not_convert=skip), progress=False)
    g = torch.Generator().manual_seed(0)
    for layer in model.model.layers:
        down = layer.mlp.down_proj
        layer.mlp.down_proj = PermutedInputQuantLinear.from_weight(down.weight_int4(), down.bias, dtype=torch.float32)
        layer.mlp.down_proj.set_input_perm(torch.randperm(down.in_features, generator=g))
    save_quantized(model, tmp_path)
    downs = [f"model.layers.{i}.mlp.down_proj" for i in range(len(model.model.layers))]
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["input_permuted_modules"] == downs

    dtype = torch.float32 if device == "cpu" else torch.float16
    model = model.to(device, dtype)
    ids = torch.randint(0, 256, (2, 12), device=device)
    with torch.no_grad():
        want = model(ids).logits
    loaded, _ = load_quantized(tmp_path, device=device, dtype=dtype)
    # transformers' from_pretrained folds them too (`hf_quantizer`), once its weights are in
    transformers_load = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device, dtype=dtype)
    for m in (loaded, transformers_load):
        assert m.config.quantization_config["input_permuted_modules"] == []
    model.requires_grad_(False)  # and a frozen model stays frozen: the fold's new 16-bit weights keep requires_grad
    assert fold_mlp_input_orders(model) == downs and fold_mlp_input_orders(model) == []
    assert not any(p.requires_grad for p in model.parameters())
    for m in (model, loaded, transformers_load):
        assert all(type(layer.mlp.down_proj) is QuantLinear for layer in m.model.layers)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)  # the same sums, in other places
        got = loaded(ids).logits
        assert torch.equal(transformers_load(ids).logits, got)
    if device == "cpu":
        assert torch.equal(got, want)
    else:  # model.to(float16) rounded its rotary inv_freq too, which load_quantized rebuilds in float32
        assert (got - want).abs().max() <= 2e-3 * want.abs().max()


def test_x_in_order_is_only_for_layers_of_one_input_order():
    # a caller that claims to have written x in the layers' order, for layers that have none (or several)
    layers = [QuantLinear.from_linear(torch.nn.Linear(64, 32), QuantConfig(group_size=32)) for _ in range(2)]
    assert shared_input_perm(layers) is None
    with pytest.raises(ValueError, match="x_in_order=True is for layers of one input permutation"):
        shared_input_forward(layers, torch.randn(3, 64), x_in_order=True)
    permuted = [PermutedInputQuantLinear.from_weight(m.weight_int4(), dtype=torch.float32) for m in layers]
    permuted[0].set_input_perm(torch.randperm(64))
    assert shared_input_perm(permuted) is None  # two orders: two launches, each its own gather
    permuted[1].set_input_perm(permuted[0].input_perm.clone())
    assert torch.equal(shared_input_perm(permuted), permuted[0].input_perm)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_truncated_checkpoint_file_is_named(tmp_path, sharded):
    qc = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32, "zero_point": True}
    write_checkpoint(tmp_path, tiny_model("llama"), qc, lambda W: write_awq_linear(W, 32), sharded=sharded)
    f = sorted(tmp_path.glob("*.safetensors"))[-1]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match=re.escape(f"{f} is missing, truncated or corrupt") + ".*re-download"):
        load_quantized(tmp_path)


def test_bad_devices_are_refused_by_name(tmp_path, monkeypatch):
    save_quantized(quantize_model(tiny_model("llama"), QuantConfig(group_size=32), progress=False), tmp_path,
                   format="gptq")
    with pytest.raises(ValueError, match="device 'gpu' is not a device torch knows"):
        load_hf_quantized(tmp_path, device="gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # not "Torch not compiled with CUDA enabled"
    for load in (load_quantized, load_hf_quantized):
        with pytest.raises(ValueError, match="device 'cuda' asked for, but no CUDA GPU is visible"):
            load(tmp_path, device="cuda")


def _export(tmp_path, name="q", fmt="awq", **overrides):
    model = quantize_model(tiny_model("llama", **overrides), QuantConfig(group_size=32), progress=False)
    save_quantized(model, tmp_path / name, format=fmt)
    return model, tmp_path / name


def test_a_tensor_held_by_two_files_is_refused_naming_both(tmp_path):
    """Without an index every *.safetensors is read, and the file that sorted last won a key both held: an export
    beside a backup of the earlier model's loaded as the backup, without a word."""
    import shutil
    _, path = _export(tmp_path)
    shutil.copy(path / "model.safetensors", path / "model_old.safetensors")
    with pytest.raises(ValueError, match=r"tensor 'model\.[^']+' is in both .*/model\.safetensors and "
                                         r".*/model_old\.safetensors"):
        load_quantized(path)


@pytest.mark.parametrize("old,new", [("gptq", "gptq_v2"), ("awq", "awq")])
def test_an_export_interrupted_between_its_two_files_is_refused(tmp_path, old, new):
    """Exports carried no digest of their config: v2 weights beside a v1 export's config.json read every zero point a
    step off, and another model's weights beside a config of other RoPE loaded as a third model."""
    import shutil
    _export(tmp_path, "old", old)
    _export(tmp_path, "new", new, rope_theta=5e5)
    shutil.copy(tmp_path / "new" / "model.safetensors", tmp_path / "old" / "model.safetensors")
    with pytest.raises(ValueError, match="saved with another config than .*config.json holds"):
        load_quantized(tmp_path / "old")


def test_an_exports_bytes_do_not_depend_on_the_metadatas_order(tmp_path):
    """safetensors writes its metadata from a hash map: with two keys the same export differed byte for byte."""
    _, path = _export(tmp_path)
    with open(path / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert list(header["__metadata__"]) == sorted(header["__metadata__"]) == ["format", "nibble"]


def test_a_stored_lm_head_is_kept_when_the_config_says_tied(tmp_path):
    """A fine-tune whose config kept its base's tie_word_embeddings: the import tied lm_head to the embedding and threw
    the stored head away (transformers keeps it, and warns). A head equal to the embedding is tied."""
    model, path = _export(tmp_path, tie_word_embeddings=False)
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(path / "model.safetensors")  # as another tool wrote it: no digest of the config
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="lm_head.weight differs from the embedding.*kept untied"):
        loaded, _ = load_quantized(path)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.half().float())
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    from nibble.models.serialization import quantized_structure  # `nibble info`'s: a meta head, kept as stored
    structure = quantized_structure(path)  # (torch.equal of meta tensors raised NotImplementedError)
    assert structure.lm_head.weight is not structure.model.embed_tokens.weight
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded, _ = load_quantized(path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_the_import_and_export_warnings_name_the_users_line(tmp_path):
    """Their fixed stacklevels named a line of nibble's (serialization.py's) wherever load_quantized reached the
    importer, or save_quantized the exporter, one frame deeper than a direct call."""
    from test_warn import said_at
    G = 32
    qc = {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": False, "sym": True,
          "checkpoint_format": "gptq"}  # but zero points stored as v2's 8: read as v2, with a warning
    write_checkpoint(tmp_path / "v2-zeros", tiny_model("llama"), qc,
                     lambda W: write_gptq_linear(W, G, True, False, "gptq_v2"))
    (tmp_path / "v2-zeros" / "generation_config.json").write_text("[]")
    for load in (load_quantized, load_hf_quantized):
        with pytest.warns(UserWarning) as record:
            load(tmp_path / "v2-zeros")
        assert {said_at(w) for w in record} == {'load(tmp_path / "v2-zeros")'}, [str(w.message) for w in record]
        assert [w.filename for w in record] == [__file__] * 2  # "read as gptq_v2", generation_config.json ignored
    model, path = _export(tmp_path, tie_word_embeddings=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    _without_digest(path)
    with pytest.warns(UserWarning, match="kept untied") as record:
        load_quantized(path)
    assert record[0].filename == __file__ and said_at(record[0]) == "load_quantized(path)"
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.zeros[0, 3] = 0.0  # which GPTQ's v1 cannot hold: written as v2, said
    with pytest.warns(UserWarning, match="have groups with zero point 0") as record:
        save_quantized(model, tmp_path / "zp0", format="gptq")
    assert record[0].filename == __file__
    assert said_at(record[0]) == 'save_quantized(model, tmp_path / "zp0", format="gptq")'


@pytest.mark.parametrize("fmt,tensor", [("awq", "scales"), ("gptq", "scales"), ("gptq", "bias")])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_scales_are_refused_naming_the_layer(tmp_path, fmt, tensor, value):
    """fp16 scales that overflowed (a known GPTQ failure) or a damaged file imported as a model that outputs NaN."""
    _, path = _export(tmp_path, fmt=fmt)
    tensors = load_file(path / "model.safetensors")
    name = f"model.layers.1.self_attn.q_proj.{tensor}"
    tensors.setdefault(name, torch.zeros(tensors["model.layers.1.self_attn.q_proj.scales"].shape[1]).half())
    tensors[name].view(-1)[3] = value
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"model\.layers\.1\.self_attn\.q_proj\.{tensor} holds 1 NaN or Inf value.*corrupt"):
        load_quantized(path)


def test_a_gptq_checkpoint_with_a_bias_on_every_linear_roundtrips_through_nibbles_format(tmp_path):
    """AutoGPTQ before 0.5 gave every quantized linear a bias: imported with them, saved in nibble's format, the
    checkpoint was refused on load ("Unexpected key(s) ... q_proj.bias") because the layers were built from the
    architecture, which has none."""
    _, path = _export(tmp_path, fmt="gptq")
    tensors = load_file(path / "model.safetensors")
    for k in [k for k in tensors if k.endswith(".qweight")]:
        tensors[k.removesuffix("qweight") + "bias"] = torch.randn(tensors[k].shape[1]).half()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    imported, _ = load_quantized(path)
    save_quantized(imported, tmp_path / "nibble")
    loaded, _ = load_quantized(tmp_path / "nibble")
    assert loaded.model.layers[0].self_attn.q_proj.bias is not None
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, imported(ids).logits)


def test_a_quantized_lm_head_is_not_tied_to_the_embedding(tmp_path):
    """GPTQModel's lm_head=True beside tie_word_embeddings: tie_weights() hung the embedding on the quantized head as
    a stray lm_head.weight, which a nibble save recorded as an alias its load refused."""
    from nibble.formats.gptq import to_gptq
    quantized_head = quantize_model(tiny_model("llama"), QuantConfig(group_size=32, modules_to_not_convert=[]),
                                    progress=False)
    _, path = _export(tmp_path, fmt="gptq")  # tied, its 16-bit head stored once as the embedding
    tensors = load_file(path / "model.safetensors")
    tensors.update({f"lm_head.{k}": v.contiguous() for k, v in to_gptq(quantized_head.lm_head.weight_int4()).items()})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    imported, _ = load_quantized(path)
    assert isinstance(imported.lm_head, QuantLinear) and not list(imported.lm_head.parameters())
    save_quantized(imported, tmp_path / "nibble")
    loaded, _ = load_quantized(tmp_path / "nibble")
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, imported(ids).logits)


@pytest.mark.parametrize("method_named", [True, False])
def test_an_autogptq_checkpoint_with_its_settings_in_quantize_config_json_alone_loads(tmp_path, method_named):
    """AutoGPTQ before 0.5 wrote its settings to quantize_config.json only (before 0.4 without quant_method): the
    importer reads that file, but load_quantized and the CLI refused the folder as "not a quantized model"."""
    from nibble.models.checkpoint_files import quantized_checkpoint
    model, path = _export(tmp_path, fmt="gptq")
    config = json.loads((path / "config.json").read_text())
    settings = config.pop("quantization_config")
    if not method_named:
        del settings["quant_method"]
    (path / "config.json").write_text(json.dumps(config))
    (path / "quantize_config.json").write_text(json.dumps(settings))
    save_file(load_file(path / "model.safetensors"), path / "model.safetensors", metadata={"format": "pt"})
    loaded, _ = load_quantized(path)
    assert quantized_checkpoint(str(path))
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
        assert (loaded(ids).logits - want).abs().max() <= 1e-2 * want.abs().max()


@pytest.mark.parametrize("version", ["GEMM", None])
def test_an_early_autoawq_checkpoint_with_its_settings_in_quant_config_json_loads(tmp_path, version):
    """Early AutoAWQ wrote its settings to quant_config.json alone, in its own keys (w_bit, q_group_size, zero_point,
    version "GEMM"; none in the earliest, whose kernel was GEMM) and without quant_method: load_quantized refused the
    folder as "not a quantized model", and the CLI took it for a float model (load_model: test_loading)."""
    from nibble.models.checkpoint_files import quantized_checkpoint
    G = 32
    model = tiny_model("llama")
    ref, dense = write_checkpoint(tmp_path, model, {}, lambda W: write_awq_linear(W, G))
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    settings = {"zero_point": True, "q_group_size": G, "w_bit": 4, "version": version, "modules_to_not_convert": None}
    (tmp_path / "quant_config.json").write_text(json.dumps({k: v for k, v in settings.items() if v is not None}))
    loaded, _ = load_quantized(tmp_path)
    assert loaded.config.quantization_config["method"] == "awq"
    check_import(loaded, dense, ref, torch.randint(0, 256, (2, 16)))
    assert quantized_checkpoint(str(tmp_path))


def test_an_autoawq_checkpoint_saved_as_pytorch_pickles_is_refused_saying_how_to_convert_it(tmp_path):
    """Early AutoAWQ saved pytorch_model.bin by default: "no *.safetensors in DIR" said nothing of the file it holds;
    converted as the refusal says, it loads."""
    G = 32
    ref, dense = write_checkpoint(tmp_path, tiny_model("llama"), {"quant_method": "awq", "version": "gemm", "bits": 4,
                                                                  "group_size": G}, lambda W: write_awq_linear(W, G))
    torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors in .*: nibble imports safetensors checkpoints only; "
                                                r"it holds pytorch_model\.bin, PyTorch pickles: convert each"):
        load_quantized(tmp_path)
    save_file(torch.load(tmp_path / "pytorch_model.bin"), tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "pytorch_model.bin").unlink()
    check_import(load_quantized(tmp_path)[0], dense, ref, torch.randint(0, 256, (2, 16)))


def test_float_weights_beside_a_quantizers_settings_file_are_named_as_such(tmp_path):
    """"config says awq but no tensor ends in .qweight", where no config.json said awq: a quant_config.json (or
    quantize_config.json) that AutoAWQ (AutoGPTQ) left beside weights saved again in float."""
    tiny_model("llama").save_pretrained(tmp_path)
    (tmp_path / "quant_config.json").write_text(json.dumps({"w_bit": 4, "q_group_size": 32, "version": "GEMM"}))
    with pytest.raises(ValueError, match=r"quant_config\.json says awq, but no tensor of the checkpoint ends in "
                                         r"\.qweight: its weights are not quantized; quant_config\.json or the weights "
                                         "belong to another checkpoint"):
        load_quantized(tmp_path)


@pytest.mark.parametrize("settings,match", [
    ({"w_bit": 4, "q_group_size": 32, "zero_point": True, "version": "GEMV"}, r"AWQ version='GEMV' is not supported"),
    ({"w_bit": 3, "q_group_size": 32, "zero_point": True, "version": "GEMM"}, r"awq checkpoint with bits=3"),
    ({"w_bit": 4, "q_group_size": 32, "zero_point": False, "version": "GEMM"}, r"AWQ with zero_point=false")])
def test_an_early_autoawq_checkpoint_nibble_cannot_read_is_refused_by_its_quant_config_json(tmp_path, settings, match):
    cfg = tiny_model("llama").config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg, default=str))
    (tmp_path / "quant_config.json").write_text(json.dumps(settings))
    with pytest.raises(UnsupportedCheckpointError, match=match):
        load_quantized(tmp_path)


def test_gptq_and_autoawq_settings_files_side_by_side_without_a_quantization_config_are_refused(tmp_path):
    cfg = tiny_model("llama").config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg, default=str))
    (tmp_path / "quant_config.json").write_text(json.dumps({"w_bit": 4, "q_group_size": 32, "version": "GEMM"}))
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 32, "sym": True}))
    with pytest.raises(UnsupportedCheckpointError, match=r"holds both quantize_config\.json \(gptq's settings\) and "
                                                         r"quant_config\.json \(awq's\)"):
        load_quantized(tmp_path)


def _without_digest(path):
    """The export's weights as another tool writes them: no digest of config.json, which may then be edited."""
    save_file(load_file(path / "model.safetensors"), path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("damage,message", [
    ("group_size null", r"gptq checkpoint with group_size=None: it must be an integer"),
    ("group_size 64.5", r"gptq checkpoint with group_size=64\.5: it must be an integer"),
    ("group_size true", r"gptq checkpoint with group_size=True: it must be an integer"),  # a bool is an int to Python
    ("index without weight_map", r"model\.safetensors\.index\.json has no weight_map"),
    ("index not JSON", r"model\.safetensors\.index\.json is not valid JSON \(.*\); re-download"),
    ("quantize_config.json not JSON", r"quantize_config\.json is not valid JSON"),
    ("vocabulary of 320", r"weights do not match the architecture config\.json describes \(Error"),
    ("fewer layers", r"the weights hold model\.layers\.1\..*, which the model config\.json describes has not .*"
                     r"num_hidden_layers 1\): the config\.json belongs to another model"),
    ("a bias of 7", r"q_proj\.bias has shape \(7,\), where the layer's 64 outputs need \(64,\)")])
def test_a_structurally_damaged_checkpoint_is_named(tmp_path, damage, message):
    """Raw KeyError, TypeError, JSONDecodeError (no file named) and torch's RuntimeError / AttributeError ("ModuleList
    has no attribute '1'"), as tracebacks in the CLI."""
    _, path = _export(tmp_path, fmt="gptq")
    _without_digest(path)
    config = json.loads((path / "config.json").read_text())
    if damage.startswith("group_size"):
        config["quantization_config"]["group_size"] = {"null": None, "64.5": 64.5, "true": True}[damage.split()[1]]
    elif damage == "vocabulary of 320":
        config["vocab_size"] = 320
    elif damage == "fewer layers":
        config["num_hidden_layers"] = 1
    elif damage.startswith("index"):
        (path / "model.safetensors.index.json").write_text("{]" if damage.endswith("JSON") else "{}")
    elif damage == "quantize_config.json not JSON":
        (path / "quantize_config.json").write_text('{"bits": 4,')
    else:
        tensors = load_file(path / "model.safetensors")
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(7).half()
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_quantized(path)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_a_bias_of_the_architecture_the_checkpoint_lacks_is_refused_naming_it(tmp_path, fmt):
    """A Qwen2 checkpoint without one of its q/k/v biases loaded that layer without one, without a word (and its
    nibble save was then refused as lacking it), where a bias beyond the architecture's is AutoGPTQ's, kept."""
    from nibble.models.serialization import quantized_structure
    model = quantize_model(tiny_model("qwen2"), QuantConfig(group_size=32), progress=False)
    save_quantized(model, tmp_path, format=fmt)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})  # as another tool writes it
    for load in (load_quantized, quantized_structure):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path))}: the checkpoint lacks model\.layers\.1\."
                                             r"self_attn\.v_proj\.bias, which the architecture config\.json describes "
                                             "has: a shard or the save is incomplete"):
            load(tmp_path)


def test_a_flipped_byte_in_an_export_fails_its_checksum(tmp_path):
    """AWQ / GPTQ files carry no checksum: one flipped byte loaded as a slightly different model without a word."""
    _, path = _export(tmp_path, fmt="gptq")
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x55
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors: checksum mismatch in 1 tensor"):
        load_quantized(path)


def test_an_upper_case_quant_method_and_a_null_zero_point_are_read_as_the_importer_reads_them(tmp_path):
    """"AWQ" was "not a nibble quantization_config" (the importer lower-cases it, but was never reached), and
    zero_point null (not said: AutoAWQ's default, true) "AWQ with zero_point=false"."""
    _, path = _export(tmp_path)
    _without_digest(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(quant_method="AWQ", zero_point=None)
    (path / "config.json").write_text(json.dumps(config))
    loaded, _ = load_quantized(path)
    assert loaded.config.quantization_config["imported_from"]["quant_method"] == "AWQ"


@pytest.mark.parametrize("config_of,weights_of,message", [
    ("awq", "gptq", r"says awq, but model\.layers\.0\.\w+\.\w+ holds gptq's tensors \(a g_idx\)"),
    ("gptq", "awq", r"says gptq, but model\.layers\.0\.\w+\.\w+ holds awq's tensors \(a \d+x\d+ qweight, packed "
                    r"along the outputs\)"),
    ("awq", "nibble", r"says awq, but model\.layers\.0\.\w+\.\w+ holds nibble's tensors \(zeros, not qzeros\)")])
def test_a_config_of_another_format_beside_the_weights_is_named(tmp_path, config_of, weights_of, message):
    """A config.json copied from a checkpoint of another format: "AWQ qweight has K=32 rows, which must be divisible
    by 8 and by group_size=64", "group_size=64 disagrees with the tensors", "cannot read its awq tensors ('qzeros')"."""
    import shutil
    model = quantize_model(tiny_model("llama"), QuantConfig(group_size=32), progress=False)
    for fmt in (config_of, weights_of):
        save_quantized(model, tmp_path / fmt, format=fmt)
    shutil.copy(tmp_path / config_of / "config.json", tmp_path / weights_of / "config.json")
    tensors = load_file(tmp_path / weights_of / "model.safetensors")  # as another tool wrote them: no digest
    save_file(tensors, tmp_path / weights_of / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message + ": the config.json belongs to another checkpoint"):
        load_quantized(tmp_path / weights_of)


@pytest.mark.parametrize("fmt,refusal", [
    ("awq", r"K=192, N=64\), group 64 needs qzeros \(3, 8\) and scales \(3, 64\); got \(6, 8\) and \(6, 64\)"),
    ("gptq", r"group_size=64 disagrees with the tensors: scales \(6, 64\) of K=192 inputs mean group size 32")])
def test_scales_of_other_groups_than_the_group_size_are_refused_by_layer(tmp_path, fmt, refusal):
    """An AutoAWQ / GPTQ checkpoint whose config.json says another group size than its scales hold: refused naming
    the layer, the scales' shape and the group size, as nibble's own loader does."""
    save_quantized(quantize_model(tiny_model("llama"), QuantConfig(group_size=32), progress=False), tmp_path, format=fmt)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(tmp_path / "model.safetensors")  # as another tool wrote them: no digest
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"model\.layers\.0\.mlp\.down_proj: cannot read its {fmt} tensors \(.*{refusal}"):
        load_quantized(tmp_path)


def test_an_index_that_names_the_wrong_shard_is_named_and_a_home_path_is_expanded(tmp_path, monkeypatch):
    """A layer missing a tensor the index put in another shard failed as "cannot read its awq tensors ('qzeros')";
    load_quantized("~/x") said "nibble never downloads models"."""
    qc = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32, "zero_point": True}
    write_checkpoint(tmp_path / "q", tiny_model("llama"), qc, lambda W: write_awq_linear(W, 32), sharded=True)
    monkeypatch.setenv("HOME", str(tmp_path))
    load_quantized("~/q")
    index = tmp_path / "q" / "model.safetensors.index.json"
    config = json.loads(index.read_text())
    key = next(k for k in config["weight_map"] if k.endswith("qzeros"))
    shards = sorted(set(config["weight_map"].values()))
    config["weight_map"][key] = next(s for s in shards if s != config["weight_map"][key])
    index.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"index\.json names .* for '{re.escape(key)}' \(1 such tensor\(s\)\), but that "
                                         "file does not hold it"):
        load_quantized(tmp_path / "q")


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
@pytest.mark.parametrize("tensor", ["qzeros", "scales"])
def test_a_layer_missing_a_tensor_is_named(tmp_path, fmt, tensor):
    """A layer without its qzeros or scales (a shard left out, a damaged save) failed as "cannot read its awq tensors
    ('qzeros')": a KeyError's repr, which said neither that a tensor is missing nor which."""
    _, path = _export(tmp_path, fmt=fmt)
    tensors = load_file(path / "model.safetensors")
    del tensors[f"model.layers.1.self_attn.k_proj.{tensor}"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})  # as another tool wrote it: no checksums
    with pytest.raises(ValueError, match=rf"lacks model\.layers\.1\.self_attn\.k_proj\.{tensor} \({fmt} layers "
                                         r"store qweight, qzeros, scales\).*re-download"):
        load_quantized(path)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_bfloat16_scales_load_as_the_float16_scales_they_equal(tmp_path, fmt):
    """A quantized model cast to bfloat16 (Module.to casts the scales too) and saved again writes bfloat16 scales, which
    vLLM and transformers read: nibble refused them ("scales must be float16"). Every bfloat16 scale in float16's
    range is a float16 exactly; one that is not (float32) is refused."""
    _, path = _export(tmp_path, fmt=fmt)
    tensors = load_file(path / "model.safetensors")
    scales = [k for k in tensors if k.endswith(".scales")]
    for k in scales:
        tensors[k] = tensors[k].bfloat16()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})  # as another tool wrote it: no checksums
    loaded, _ = load_quantized(path)
    for k in scales:
        tensors[k] = tensors[k].half()  # the same values, in float16
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    want, _ = load_quantized(path)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want(ids).logits)
    tensors[scales[0]] = tensors[scales[0]].float() * (1 + 2 ** -20)  # between two float16 values
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"cannot read its {fmt} tensors \(scales are torch\.float32, and \d+ of them "
                                         r"\(e\.g\. [\d.e-]+\) are no float16 value"):
        load_quantized(path)


def test_gptqmodel_dynamic_rules_are_read_per_layer(tmp_path):
    """GPTQModel's quantization_config `dynamic` ({pattern: overrides}; the first pattern that re.matches a layer's name
    rules it, "-:" ones leave it unquantized, as GPTQModel and vLLM read them) was ignored: an 8-bit layer, four codes
    a word, was read as a 4-bit one of twice the inputs and refused as "group_size=32 disagrees with the tensors", as
    was a layer of another group size, which nibble cannot hold either; both are now said as they are. A rule's sym
    is the layer's: the import is symmetric only where every layer is."""
    G, ids, layers = 32, torch.randint(0, 256, (2, 16)), iter(LINEARS * 2)

    def write(W):  # in write_checkpoint's order
        return write_gptq_linear(W, G, next(layers) != "mlp.up_proj", False)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": G, "sym": True, "desc_act": False,
          "dynamic": {r"-:lm_head": {}, r".*\.up_proj": {"sym": False}}}
    ref, dense = write_checkpoint(tmp_path, tiny_model("llama"), qc, write)
    loaded, _ = load_quantized(tmp_path)
    check_import(loaded, dense, ref, ids)
    assert loaded.config.quantization_config["symmetric"] is False  # not every layer is

    tensors = load_file(tmp_path / "model.safetensors")
    name, (K, N) = "model.layers.1.mlp.down_proj", (192, 64)
    tensors.update({f"{name}.qweight": torch.zeros(K // 4, N, dtype=torch.int32),  # GPTQModel's 8-bit packing
                    f"{name}.qzeros": torch.zeros(K // G, N // 4, dtype=torch.int32),
                    f"{name}.scales": torch.ones(K // G, N, dtype=torch.float16), f"{name}.g_idx": torch.arange(K) // G})
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    rules = config["quantization_config"]["dynamic"]
    for rule, refusal in (({"bits": 8}, r"has 8 bits \(the quantization_config's dynamic rule '\+:\.\*\\\.1\\\.mlp.*"
                                        r"nibble imports .*bits=4"),
                          ({"group_size": 64}, r"has group size 64 \(the quantization_config's dynamic rule "
                                               r"'\+:\.\*\\\.1\\\.mlp\\\.down_proj'\), the other layers 32")):
        config["quantization_config"]["dynamic"] = {r"+:.*\.1\.mlp\.down_proj": rule, **rules}  # the first match rules
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(UnsupportedCheckpointError, match=r"model\.layers\.1\.mlp\.down_proj " + refusal):
            load_quantized(tmp_path)
    for rules, refusal in (({"+:(": {}}, r"dynamic rule '\+:\(' is not a regular expression"),
                           (["+:.*"], r"dynamic is \['\+:\.\*'\], not GPTQModel's \{pattern: overrides\}")):
        config["quantization_config"]["dynamic"] = rules
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(UnsupportedCheckpointError, match=refusal + ".*: the quantization_config is damaged"):
            load_quantized(tmp_path)


class _ReadsRecorded:
    """safetensors' ``safe_open``, the names of the tensors whose data is read (``get_tensor``) kept in ``reads``."""

    def __init__(self, reads: list, real):
        self.reads, self.real = reads, real

    def __call__(self, *args, **kwargs):
        self.file = self.real(*args, **kwargs)
        return self

    def __enter__(self):
        self.inner = self.file.__enter__()
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)

    def get_tensor(self, name):
        self.reads.append(name)
        return self.inner.get_tensor(name)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _info_fixture(path, kind):
    """A tiny checkpoint of ``kind`` and the suffixes of the tensors whose data `nibble info` reads of it."""
    G = 32
    if kind == "awq":  # sharded, with biases (Qwen2's q/k/v): an index and two files
        qc = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": G, "zero_point": True}
        write_checkpoint(path, tiny_model("qwen2"), qc, lambda W: write_awq_linear(W, G), sharded=True)
        return ()
    if kind == "gptq act order":  # permuted inputs, down_proj's order folded into gate / up
        _act_order_checkpoint(path, shared=True)
        return (".g_idx",)
    if kind == "gptq, sym unsaid":  # symmetric as its zero points say
        qc = {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": False}
        write_checkpoint(path, tiny_model("llama"), qc, lambda W: write_gptq_linear(W, G, True, False))
        return (".g_idx", ".qzeros", ".scales")
    save_quantized(quantize_model(tiny_model("llama"), QuantConfig(group_size=G), progress=False), path)  # nibble's
    return ()


@pytest.mark.parametrize("kind", ["awq", "gptq act order", "gptq, sym unsaid", "nibble"])
def test_info_prints_what_the_load_builds_from_the_headers_without_loading(tmp_path, monkeypatch, capsys, kind):
    """`nibble info` loaded the whole model (every tensor, its 16-bit ones in float32) to print a summary of it:
    minutes and the model's size in memory for a large checkpoint. It reads config.json, the settings and the
    safetensors headers, and of the data a GPTQ layer's g_idx alone (and, sym unsaid, its qzeros and scales), and
    prints what it printed of the loaded model."""
    import nibble.models.hf_import as hf_import
    import nibble.models.serialization as serialization
    from nibble.cli import main

    path = tmp_path / "q"
    read_suffixes = _info_fixture(path, kind)
    with monkeypatch.context() as patched:  # as info ran before: on the loaded model
        patched.setattr(serialization, "quantized_structure", lambda d: load_quantized(d, tokenizer=False)[0])
        main(["info", str(path)])
    loaded = json.loads(capsys.readouterr().out)

    def refuse(*args, **kwargs):
        raise AssertionError("nibble info loaded the model")
    for module, name in ((serialization, "load_quantized"), (serialization, "load_hf_quantized"),
                         (hf_import, "load_hf_quantized")):
        monkeypatch.setattr(module, name, refuse)
    reads = []
    for module in (serialization, hf_import):
        monkeypatch.setattr(module, "safe_open", _ReadsRecorded(reads, module.safe_open))
    main(["info", str(path)])
    assert json.loads(capsys.readouterr().out) == loaded
    assert reads and all(name.endswith(read_suffixes) for name in reads) if read_suffixes else reads == []
    assert loaded["quantized_linears"] == 14 and loaded["dtype"] == "float32"
    assert loaded["quantization_config"]["group_size"] == 32
    if kind == "gptq act order":
        assert len(loaded["quantization_config"]["input_permuted_modules"]) == 12  # 2 layers x 6: down_proj folded
    if kind == "gptq, sym unsaid":
        assert loaded["quantization_config"]["symmetric"] is True


@pytest.mark.parametrize("recorded, device, expected", [
    ({"torch_dtype": "bfloat16"}, "cuda", torch.bfloat16), ({"dtype": "bfloat16"}, "cuda", torch.bfloat16),
    ({"torch_dtype": "float16"}, "cuda", torch.float16), ({"torch_dtype": "float32"}, "cuda", torch.float16),
    ({}, "cuda", torch.float16), ({"torch_dtype": "bogus"}, "cuda", torch.float16),
    ({"torch_dtype": "bfloat16"}, "cpu", torch.float32), ({"dtype": "float16"}, "cpu", torch.float32)])
def test_an_import_runs_in_its_recorded_16_bit_dtype_on_a_gpu_and_in_float32_on_the_cpu(recorded, device, expected):
    """A bfloat16 GPTQModel checkpoint ran in float16 on a GPU (its embeddings and norms recast, which may overflow),
    where load_quantized's docstring promised the dtype the model was saved in."""
    from nibble.models.hf_import import import_dtype
    assert import_dtype(recorded, torch.device(device)) == expected


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_bfloat16_export_loads_in_bfloat16_on_a_gpu_and_in_float32_on_the_cpu(tmp_path, device):
    _, path = _export(tmp_path, fmt="gptq")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    model, _ = load_quantized(path, device=device)
    want = torch.bfloat16 if device == "cuda" else torch.float32
    assert model.dtype == want and model.model.embed_tokens.weight.dtype == want


@pytest.mark.parametrize("tensor", ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias"])
def test_an_imported_value_the_asked_dtype_cannot_hold_is_refused_naming_the_tensor(tmp_path, tensor):
    """A checkpoint holding bfloat16 tensors (a quantized layer's bias among them) loaded with dtype=float16 cast
    1e6 to Inf without a word, and the model answered NaN."""
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False}
    write_checkpoint(tmp_path, tiny_model("qwen2"), qc, lambda W: write_gptq_linear(W, 32, False, False))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors[tensor] = tensors[tensor].bfloat16()
    tensors[tensor].view(-1)[3] = 1e6
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{re.escape(tensor)} holds 1 value\(s\) beyond torch\.float16's range "
                                         r"\(e\.g\. 999424\), which would load as Inf there"):
        load_hf_quantized(tmp_path, dtype=torch.float16)
    loaded, _ = load_hf_quantized(tmp_path)  # float32 on the CPU holds it
    assert loaded.state_dict()[tensor].view(-1)[3] == 999424


def test_a_gptqmodel_dynamic_rule_matches_a_layer_by_the_start_of_its_name(tmp_path):
    """GPTQModel and vLLM re.match each rule's pattern: a pattern naming the start of a layer's name (no ".*" to end
    it) rules that layer. Read whole (fullmatch), it ruled none, and the up_projs were read as symmetric."""
    G, ids, layers = 32, torch.randint(0, 256, (2, 16)), iter(LINEARS * 2)

    def write(W):  # in write_checkpoint's order
        return write_gptq_linear(W, G, next(layers) != "mlp.up_proj", False)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": G, "sym": True, "desc_act": False,
          "dynamic": {r"+:model\.layers\.\d+\.mlp\.up": {"sym": False}}}
    ref, dense = write_checkpoint(tmp_path, tiny_model("llama"), qc, write)
    loaded, _ = load_quantized(tmp_path)
    check_import(loaded, dense, ref, ids)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_a_nan_among_bfloat16_scales_is_refused_as_non_finite(tmp_path, fmt):
    """bfloat16 scales are read as the float16 values they equal; a NaN or Inf among them is said as such (naming the
    tensor), not as a value float16 cannot hold."""
    _, path = _export(tmp_path, fmt=fmt)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.q_proj.scales"
    tensors[name] = tensors[name].bfloat16()
    tensors[name].view(-1)[3] = float("nan")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{re.escape(name)} holds 1 NaN or Inf value.*corrupt"):
        load_quantized(path)


@pytest.mark.parametrize("library,method", [("nibble", "qat"), ("nibble", None), ("another", "rtn")])
def test_an_export_naming_a_method_nibble_does_not_know_is_read_as_its_layouts(tmp_path, library, method):
    """quantized_by says how a nibble export's weights were made: a method this nibble does not know (a later one's,
    or none) is no QuantConfig method, and the import records the layout's, as for any other tool's checkpoint; so
    does a quantized_by another library wrote."""
    _, path = _export(tmp_path)
    _without_digest(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["quantized_by"].update(library=library, method=method)
    (path / "config.json").write_text(json.dumps(config))
    assert load_quantized(path)[0].config.quantization_config["method"] == "awq"


def test_an_infinite_value_the_model_holds_itself_is_exported_as_it_is(tmp_path):
    """The float16 range check refuses a finite value float16 would make Inf; an Inf the model holds (its own) is
    written as it is, for the reader to judge, not called beyond float16's range."""
    model = tiny_model("llama", tie_word_embeddings=False)
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("inf")
    save_quantized(model, tmp_path / "q", format="gptq")
    assert torch.isinf(load_file(tmp_path / "q" / "model.safetensors")["lm_head.weight"][0, 0])


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_a_per_channel_model_of_layers_of_several_widths_exports_as_group_size_minus_one(tmp_path, fmt):
    """group_size=-1 gives each layer one group of its in_features (64 for q_proj, 192 for down_proj): one setting,
    -1, that the export writes, not "layers use different group sizes". Every 16-bit tensor, the biases of the
    quantized layers too, is written in float16, as AutoAWQ writes them."""
    model = tiny_model("qwen2")
    quantize_model(model, QuantConfig(group_size=-1), progress=False)
    save_quantized(model, tmp_path / "q", format=fmt)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["group_size"] == -1
    written = load_file(tmp_path / "q" / "model.safetensors")
    assert {t.dtype for t in written.values() if t.is_floating_point()} == {torch.float16}
    assert "model.layers.0.self_attn.q_proj.bias" in written
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(load_quantized(tmp_path / "q")[0](ids).logits, model(ids).logits,
                                   rtol=1e-3, atol=1e-3)


def test_an_act_order_model_is_refused_the_awq_export_which_cannot_hold_its_input_orders(tmp_path):
    """AWQ has no g_idx: a layer whose inputs are permuted (a GPTQ act-order import; down_proj's order is folded, q/k/v
    and gate/up keep theirs) was written in its permuted order as a plain layer, another model for every reader."""
    _act_order_checkpoint(tmp_path / "gptq", shared=True)
    model, _ = load_quantized(tmp_path / "gptq")
    with pytest.raises(ValueError, match=r"self_attn\.q_proj.*input permutation \(GPTQ act-order\), which AWQ cannot "
                                         r"express; use export_gptq"):
        save_quantized(model, tmp_path / "awq", format="awq")
    assert not (tmp_path / "awq").exists()


def test_config_jsons_quantization_config_wins_over_a_settings_file_beside_it(tmp_path):
    """transformers and vLLM read config.json's quantization_config: a quantize_config.json beside it (an earlier
    AutoGPTQ save's, with another group size) is read only for what config.json leaves unsaid."""
    model, path = _export(tmp_path, fmt="gptq")
    (path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128, "sym": True,
                                                           "desc_act": False}))
    # and an AutoAWQ quant_config.json too: two tools' settings, refused only where config.json says nothing
    (path / "quant_config.json").write_text(json.dumps({"w_bit": 4, "q_group_size": 64, "version": "GEMM"}))
    loaded, _ = load_quantized(path)
    assert loaded.config.quantization_config["group_size"] == 32
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("tensor", ["model.norm.weight", "model.embed_tokens.weight"])
def test_a_nan_in_a_16_bit_tensor_of_an_import_is_refused_naming_it(tmp_path, tensor):
    """The import checked the quantized layers' scales, zeros and biases: a NaN in an embedding or a norm (a damaged
    file) loaded, and the model answered NaN."""
    _, path = _export(tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors[tensor].view(-1)[5] = float("nan")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{re.escape(tensor)} holds 1 NaN or Inf value"):
        load_quantized(path)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_an_export_says_its_16_bit_dtype_and_every_linear_it_keeps_in_16_bits(tmp_path, fmt):
    """config.json says float16, the dtype the export writes the 16-bit tensors in (a float32 model's said float32),
    and modules_to_not_convert names every nn.Linear left in 16 bits (the down_projs kept too, not lm_head alone),
    which AutoAWQ, transformers and vLLM load as plain linears."""
    model = tiny_model("llama")
    quantize_model(model, QuantConfig(group_size=32, modules_to_not_convert=["lm_head", "down_proj"]), progress=False)
    save_quantized(model, tmp_path / "q", format=fmt)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "float16"
    assert config["quantization_config"]["modules_to_not_convert"] == [
        "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "lm_head"]


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_a_quantization_config_without_a_group_size_reads_the_tools_default_128(tmp_path, fmt):
    """AutoAWQ's and AutoGPTQ's default group size is 128: a quantization_config that leaves it unsaid holds groups
    of 128 (another default read every layer as "group_size disagrees with the tensors")."""
    model = quantize_model(tiny_model("llama", hidden_size=128, intermediate_size=256), QuantConfig(group_size=128),
                           progress=False)
    save_quantized(model, tmp_path, format=fmt)
    _without_digest(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]["group_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded, _ = load_quantized(tmp_path)
    assert loaded.config.quantization_config["group_size"] == 128
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-3, atol=1e-3)


def test_a_sharded_checkpoint_reads_the_files_its_index_names_and_no_other(tmp_path):
    """Mistral's repositories hold consolidated.safetensors, the same weights again, beside the shards their
    model.safetensors.index.json names: read too, each of its tensors would be "in both" files."""
    import shutil
    qc = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32, "zero_point": True}
    ref, dense = write_checkpoint(tmp_path, tiny_model("llama"), qc, lambda W: write_awq_linear(W, 32), sharded=True)
    shutil.copy(tmp_path / "model-00001-of-00002.safetensors", tmp_path / "consolidated.safetensors")
    check_import(load_quantized(tmp_path)[0], dense, ref, torch.randint(0, 256, (2, 16)))


def test_a_gptqmodel_dynamic_rule_does_not_match_a_layer_in_the_middle_of_its_name(tmp_path):
    """re.match, as GPTQModel and vLLM read the rules: "self_attn" names no layer (each name starts "model."), so every
    layer keeps the config's sym=true; searched anywhere in the name, it made q/k/v/o asymmetric."""
    G = 32
    qc = {"quant_method": "gptq", "bits": 4, "group_size": G, "sym": True, "desc_act": False,
          "dynamic": {r"+:self_attn": {"sym": False}}}
    ref, dense = write_checkpoint(tmp_path, tiny_model("llama"), qc, lambda W: write_gptq_linear(W, G, True, False))
    loaded, _ = load_quantized(tmp_path)
    assert loaded.config.quantization_config["symmetric"] is True
    check_import(loaded, dense, ref, torch.randint(0, 256, (2, 16)))


@pytest.mark.parametrize("damage", ["lacks model.norm.weight", "holds model.extra.weight"])
def test_16_bit_tensors_of_another_architecture_are_refused_by_the_load_and_by_info(tmp_path, damage):
    """A 16-bit tensor the architecture has and the checkpoint lacks, or one it holds that the architecture has not,
    is another model's file: refused by name, by the load and by the structure `nibble info` prints."""
    from nibble.models.serialization import quantized_structure
    _, path = _export(tmp_path)
    tensors = load_file(path / "model.safetensors")
    if damage.startswith("lacks"):
        del tensors["model.norm.weight"]
    else:
        tensors["model.extra.weight"] = torch.randn(4).half()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})  # as another tool wrote it: no checksums
    said = r"missing \['model\.norm\.weight'\], unexpected \[\]" if damage.startswith("lacks") else \
        r"missing \[\], unexpected \['model\.extra\.weight'\]"
    for load in (load_quantized, quantized_structure):
        with pytest.raises(ValueError, match=r"checkpoint does not match the architecture \(" + said):
            load(path)


def test_quantized_layers_of_other_widths_than_config_json_says_are_refused_naming_the_layer(tmp_path):
    """Every linear of an MLP is quantized, its shape read from its tensors: with config.json's intermediate_size
    edited, the layers were built as the tensors say, and a model other than config.json describes loaded."""
    from nibble.models.serialization import quantized_structure
    _, path = _export(tmp_path, fmt="gptq")
    _without_digest(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    for load in (load_quantized, quantized_structure):
        with pytest.raises(ValueError, match=r"^model\.layers\.0\.mlp\.down_proj: checkpoint holds a 64x192 weight but "
                                             "the architecture expects 64x256"):
            load(path)


def test_an_export_refuses_a_float_model_and_one_of_several_group_sizes(tmp_path):
    """A quantization_config holds one group size: layers of 32 and of 64 were written as per channel (-1), and every
    reader took their scales for groups of the whole row. A float model is told to quantize first."""
    with pytest.raises(ValueError, match="model has no QuantLinear layers: quantize it with nibble.quantize_model first"):
        export_awq(tiny_model("llama"), tmp_path / "float")
    model = quantize_model(tiny_model("llama"), QuantConfig(group_size=32), progress=False)
    model.model.layers[1].mlp.down_proj = QuantLinear.from_linear(torch.nn.Linear(192, 64), QuantConfig(group_size=64))
    for export, method in ((export_awq, "awq"), (export_gptq, "gptq")):
        with pytest.raises(ValueError, match=rf"^layers use different group sizes \[32, 64\]; the {method} "
                                             "quantization_config holds one"):
            export(model, tmp_path / method)


@pytest.mark.parametrize("symmetric", [False, True])
def test_a_gptq_export_records_the_models_sym_and_clip_search(tmp_path, symmetric):
    """vLLM and transformers pick their GPTQ kernels by sym (Marlin's take symmetric checkpoints): a symmetric model was
    written as sym=false. RTN's clip search is recorded too, and read back by nibble's import (it read back False)."""
    config = QuantConfig(group_size=32, symmetric=symmetric, clip_search=True)
    save_quantized(quantize_model(tiny_model("llama"), config, progress=False), tmp_path, format="gptq")
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["sym"] is symmetric
    qc = load_quantized(tmp_path)[0].config.quantization_config
    assert (qc["method"], qc["clip_search"], qc["symmetric"]) == ("rtn", True, symmetric)


def test_an_import_is_in_eval_mode_and_its_config_says_the_dtype_it_runs_in(tmp_path):
    """As from_pretrained leaves a model: dropout off (the frame built from config.json was left training), and
    config.dtype the dtype asked for (it said float32 of a bfloat16 import, which a save then recorded)."""
    _, path = _export(tmp_path, fmt="gptq")
    model, _ = load_hf_quantized(path, dtype=torch.bfloat16)
    assert not model.training
    assert model.dtype == model.config.dtype == torch.bfloat16
