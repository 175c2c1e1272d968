"""peft LoRA on nibble's quantized layers (`nibble.nn.lora`): the adapters see the gradients a 16-bit twin holding
the dequantized weights gives them, and what cannot be done is refused by name."""
import copy

import pytest
import torch

from conftest import tiny_model

peft = pytest.importorskip("peft")

from nibble import QuantConfig, quantize_model  # noqa: E402
from nibble.kernels.reference import dequantize  # noqa: E402
from nibble.models.convert import quantized_linears  # noqa: E402
from nibble.nn import QuantLinear  # noqa: E402
from nibble.nn.lora import QuantLoraLinear, lora_config  # noqa: E402

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _dequantized_twin(model):
    """The model with each QuantLinear replaced by the nn.Linear of its dequantized weight."""
    twin = copy.deepcopy(model)
    for name, q in quantized_linears(twin):
        linear = torch.nn.Linear(q.in_features, q.out_features, q.bias is not None)
        linear.weight.data = dequantize(q.qweight, q.scales, q.zeros, q.group_size).contiguous()
        if q.bias is not None:
            linear.bias.data = q.bias.float()
        parent, _, child = name.rpartition(".")
        setattr(twin.get_submodule(parent), child, linear)
    return twin


def _adapted(quantized, *more: str, std: float = 0.1):
    """``quantized`` under peft LoRA adapters ("default" and ``more``) whose B is random (peft starts it at 0, where an
    adapter adds nothing and its A gets no gradient)."""
    adapted = peft.get_peft_model(quantized, lora_config(r=4, target_modules=TARGETS))
    for name in more:
        adapted.add_adapter(name, lora_config(r=4, target_modules=TARGETS))
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if "lora_B" in n:
                p.normal_(0, std)
    return adapted


def _lora_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if "lora_" in n}


def test_w4a16_adapters_learn_as_on_the_dequantized_twin():
    torch.manual_seed(0)
    quantized = quantize_model(tiny_model("llama"), QuantConfig(group_size=32), progress=False)
    twin = _dequantized_twin(quantized)
    adapted = peft.get_peft_model(quantized, lora_config(r=4, target_modules=TARGETS))
    reference = peft.get_peft_model(twin, peft.LoraConfig(r=4, target_modules=TARGETS))
    wrapped = [m for m in adapted.modules() if isinstance(m, QuantLoraLinear)]
    assert len(wrapped) == 3 * len(quantized.model.layers)
    theirs = {n: p for n, p in reference.named_parameters() if "lora_" in n}
    with torch.no_grad():  # B starts at 0: give it values so that every adapter and the input gradients matter
        for n, p in adapted.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
            if "lora_" in n:
                theirs.pop(n).copy_(p)
    assert not theirs
    ids = torch.randint(0, 256, (2, 11))
    loss, grads = _lora_grads(adapted, ids)
    want_loss, want = _lora_grads(reference, ids)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want.keys() and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    for n in grads:  # the first layer's adapters too: the gradient went through every QuantLinear below them
        torch.testing.assert_close(grads[n], want[n], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_w4a4_adapters_train_and_disable_to_the_quantized_model(rotation):
    torch.manual_seed(0)
    quantized = quantize_model(tiny_model("llama"), QuantConfig(mode="w4a4", rotation=rotation), progress=False)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        before = quantized(ids).logits
    adapted = peft.get_peft_model(quantized, lora_config(r=4, target_modules=TARGETS))
    with torch.no_grad():
        assert torch.equal(adapted(input_ids=ids).logits, before)  # B = 0: the adapters add nothing yet
    optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        loss = adapted(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with torch.no_grad():
        with adapted.disable_adapter():
            assert torch.equal(adapted(input_ids=ids).logits, before)
        assert not torch.equal(adapted(input_ids=ids).logits, before)


def test_what_cannot_be_done_is_refused_by_name():
    quantized = quantize_model(tiny_model("llama"), QuantConfig(group_size=32), progress=False)
    with pytest.raises(ValueError, match="'all-linear' finds torch's nn.Linear layers only"):
        lora_config(target_modules="all-linear")
    for bias in ("all", "lora_only"):
        with pytest.raises(ValueError, match=f"bias='{bias}' trains the model's bias Parameters"):
            lora_config(r=4, target_modules=TARGETS, bias=bias)
    with pytest.raises(ValueError, match="DoRA"):
        peft.get_peft_model(copy.deepcopy(quantized), lora_config(r=4, target_modules=TARGETS, use_dora=True))
    adapted = peft.get_peft_model(quantized, lora_config(r=4, target_modules=TARGETS))
    with pytest.raises(ValueError, match="cannot be merged into a nibble layer's INT4 weights"):
        adapted.merge_and_unload()


def _refused_merge_changes_nothing(adapted, ids, adapter_names=None):
    with torch.no_grad():
        with adapted.disable_adapter():
            base = adapted(input_ids=ids).logits
        before = adapted(input_ids=ids).logits
        saved = peft.get_peft_model_state_dict(adapted)
        for merge in (adapted.merge_adapter, adapted.merge_and_unload):
            with pytest.raises(ValueError, match="cannot be merged into a nibble layer's INT4 weights"):
                merge(adapter_names=adapter_names)
            assert torch.equal(adapted(input_ids=ids).logits, before)
            with adapted.disable_adapter():
                assert torch.equal(adapted(input_ids=ids).logits, base)
            assert peft.get_peft_model_state_dict(adapted).keys() == saved.keys()


def test_a_refused_merge_leaves_the_16_bit_layers_before_it_unmerged():
    """peft merges module by module: a 16-bit layer ahead of the first nibble one was merged and unwrapped before the
    refusal, so ``disable_adapter`` no longer gave the base model and a save lost its adapter."""
    torch.manual_seed(0)
    quantized = quantize_model(tiny_model("llama"), QuantConfig(
        group_size=32, modules_to_not_convert=["lm_head", "model.layers.0.self_attn.q_proj"]), progress=False)
    ids = torch.randint(0, 256, (2, 7))
    for active in ("default", "c"):  # an adapter added later (add_adapter) too: its 16-bit layers were not told
        adapted = _adapted(copy.deepcopy(quantized), "c")
        adapted.set_adapter(active)
        adapted.eval()
        _refused_merge_changes_nothing(adapted, ids)
    # merged by name while an adapter on the 16-bit layer alone is active: the 16-bit layer checks the adapters it is
    # asked to merge, not the active ones (which let it merge 'default' before a nibble layer refused it)
    adapted = _adapted(copy.deepcopy(quantized))
    adapted.add_adapter("b", lora_config(r=4, target_modules=["layers.0.self_attn.q_proj"]))
    adapted.set_adapter("b")
    adapted.eval()
    _refused_merge_changes_nothing(adapted, ids, ["default"])
    # an adapter on 16-bit layers alone merges as peft's own does: by itself, and beside one on nibble layers too
    # (whose layers refused every merge: the 16-bit layers merged before them stayed merged)
    beside = peft.get_peft_model(copy.deepcopy(quantized), lora_config(r=4, target_modules=TARGETS))
    beside.add_adapter("b", lora_config(r=4, target_modules=["layers.0.self_attn.q_proj"]))
    beside.set_adapter("b")
    only_16_bit = peft.get_peft_model(quantized, lora_config(r=4, target_modules=["layers.0.self_attn.q_proj"]))
    for adapted, name in ((beside, "b"), (only_16_bit, "default")):
        with torch.no_grad():
            adapted.base_model.model.model.layers[0].self_attn.q_proj.lora_B[name].weight.normal_()
            adapted_logits = adapted(input_ids=ids).logits
            merged = adapted.merge_and_unload()
            assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
            torch.testing.assert_close(merged(input_ids=ids).logits, adapted_logits, rtol=1e-4, atol=1e-4)


def test_a_batch_whose_rows_name_their_adapters_runs_each_its_own():
    """peft's adapter_names (mixed-batch inference) was dropped: every row got the active adapter."""
    torch.manual_seed(0)
    quantized = quantize_model(tiny_model("llama"), QuantConfig(group_size=32), progress=False)
    adapted = _adapted(quantized, "b")
    adapted.eval()
    ids = torch.randint(0, 256, (3, 7))
    with torch.no_grad():
        mixed = adapted(input_ids=ids, adapter_names=["__base__", "b", "default"]).logits
        with adapted.disable_adapter():
            base = adapted(input_ids=ids).logits
        adapted.set_adapter("b")
        only_b = adapted(input_ids=ids).logits
        adapted.set_adapter("default")
        only_default = adapted(input_ids=ids).logits
    torch.testing.assert_close(mixed, torch.stack([base[0], only_b[1], only_default[2]]), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(only_b, only_default)


def test_svd_combination_and_refused_inits():
    quantized = quantize_model(tiny_model("llama"), QuantConfig(group_size=32), progress=False)
    with pytest.raises(ValueError, match="init_lora_weights='pissa' starts from the layer's 16-bit weight"):
        peft.get_peft_model(copy.deepcopy(quantized), lora_config(r=4, target_modules=TARGETS, init_lora_weights="pissa"))
    adapted = _adapted(quantized, "b")
    # SVD keeps rank 4: the combination of one adapter with another at weight 0 is that adapter's delta again
    adapted.add_weighted_adapter(["default", "b"], [1.0, 0.0], "combined", combination_type="svd")
    layer = next(m for m in adapted.modules() if isinstance(m, QuantLoraLinear))
    want = layer.get_delta_weight("default")
    assert want.abs().max() > 0
    # the delta is what the adapter adds to the layer's output, scaling included (a delta without it combined
    # with itself as consistently, and passed)
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        torch.testing.assert_close(layer(x) - layer.base_layer(x), x @ want.T, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.get_delta_weight("combined"), want, rtol=1e-3, atol=1e-5)


def test_adapters_save_their_own_way_and_the_quantized_model_refuses_them(tmp_path):
    """transformers' add_adapter + save_pretrained (Trainer's checkpoints) writes the adapter alone: it was refused
    with the quantized model's save; save_quantized of a model wearing adapters wrote what nothing could load."""
    from nibble import load_quantized, save_quantized
    quantized = quantize_model(tiny_model("llama"), QuantConfig(group_size=32), progress=False)
    save_quantized(quantized, tmp_path / "base")
    model, _ = load_quantized(tmp_path / "base")
    model.add_adapter(lora_config(r=4, target_modules=TARGETS), adapter_name="a")
    model.save_pretrained(tmp_path / "adapter")
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert not (tmp_path / "adapter" / "model.safetensors").exists()  # the adapter alone
    with pytest.raises(ValueError, match="holds peft adapters: save the adapter with its save_pretrained"):
        save_quantized(model, tmp_path / "wrapped")
    with pytest.raises(ValueError, match="holds peft adapters"):
        save_quantized(peft.get_peft_model(load_quantized(tmp_path / "base")[0], lora_config(r=4, target_modules=TARGETS)),
                       tmp_path / "wrapped", format="awq")
    assert not (tmp_path / "wrapped").exists()


def test_the_engine_runs_a_peft_model_with_its_adapters():
    from nibble.eval.engine import Engine
    torch.manual_seed(0)
    quantized = quantize_model(tiny_model("llama"), QuantConfig(group_size=32), progress=False)
    adapted = _adapted(quantized, std=0.3)
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        want = adapted.generate(input_ids=ids, max_new_tokens=5, do_sample=False)[:, 6:]
        with adapted.disable_adapter():
            base = adapted.generate(input_ids=ids, max_new_tokens=5, do_sample=False)[:, 6:]
    assert not torch.equal(want, base)  # the adapters change the tokens: the engine must keep them
    assert torch.equal(Engine(adapted, max_seq_len=16).generate(ids, 5), want)


def test_a_saved_adapter_loads_back_onto_the_quantized_model(tmp_path):
    from nibble.nn.lora import load_adapter
    quantized = quantize_model(tiny_model("llama"), QuantConfig(mode="w4a4", rotation="hadamard"), progress=False)
    fresh, clean, spare = copy.deepcopy(quantized), copy.deepcopy(quantized), copy.deepcopy(quantized)
    adapted = _adapted(quantized)
    adapted.save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (2, 7))
    # is_trainable reaches peft onto a plain model too: its adapter comes back trainable
    trainable = [p.requires_grad for n, p in load_adapter(spare, tmp_path, is_trainable=True).named_parameters()
                 if "lora_" in n]
    assert trainable and all(trainable)
    with torch.no_grad():
        loaded = load_adapter(fresh, tmp_path)
        assert torch.equal(loaded(input_ids=ids).logits, adapted(input_ids=ids).logits)
    # a second adapter onto the PeftModel (peft's own load_adapter said "QuantLinear is not supported")
    other = _adapted(clean, std=0.2)
    other.save_pretrained(tmp_path / "other")
    assert load_adapter(loaded, tmp_path / "other", "other") is loaded
    with torch.no_grad():
        loaded.set_adapter("other")
        assert torch.equal(loaded(input_ids=ids).logits, other(input_ids=ids).logits)
        loaded.set_adapter("default")
        assert torch.equal(loaded(input_ids=ids).logits, adapted(input_ids=ids).logits)
    with pytest.raises(ValueError, match="adapter named 'other' already"):
        load_adapter(loaded, tmp_path / "other", "other")
    loaded.train()
    load_adapter(loaded, tmp_path / "other", "trained", is_trainable=True)  # it was left frozen
    trainable = [p.requires_grad for n, p in loaded.named_parameters() if ".trained." in n]
    assert trainable and all(trainable)
    # as peft's own load_adapter: a trainable adapter's config is not in inference mode, and loading it keeps the
    # model training (peft puts it in eval mode, dropout off, for an adapter loaded for inference only)
    assert not loaded.peft_config["trained"].inference_mode and loaded.peft_config["other"].inference_mode
    assert loaded.training


class _Net(torch.nn.Module):
    """One nibble layer and one 16-bit layer after it: peft's LoRA on a model of any kind, built in milliseconds."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.proj = QuantLinear.from_linear(torch.nn.Linear(64, 32, dtype=dtype), QuantConfig(group_size=32))
        self.head = torch.nn.Linear(32, 8, dtype=dtype)

    def forward(self, x):
        return self.head(self.proj(x))


def test_a_quant_lora_layer_adds_its_scaled_branch_on_the_dropped_out_input_in_the_layers_dtype():
    """y = base(x) + (s B A dropout(x)) rounded to the base output's dtype: the float32 adapter on a bfloat16 layer
    gives bfloat16, and in training the dropout peft was configured with applies ('gaussian' init, which
    nibble takes, starts B at 0: given values here)."""
    torch.manual_seed(31)
    adapted = peft.get_peft_model(_Net(torch.bfloat16), lora_config(r=4, lora_alpha=8, target_modules=["proj"],
                                                                    lora_dropout=0.5, init_lora_weights="gaussian"))
    layer = adapted.base_model.model.proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.no_grad():
        b.normal_()
    assert a.dtype == torch.float32 and layer.scaling["default"] == 2.0
    x = torch.randn(5, 64).bfloat16()
    layer.train()
    with torch.no_grad():
        torch.manual_seed(32)
        y = layer(x)
        torch.manual_seed(32)
        dropped = torch.nn.functional.dropout(x.float(), 0.5, training=True)  # the same draw: the same mask
        want = layer.base_layer(x) + (dropped.double() @ a.double().T @ b.double().T * 2.0).bfloat16()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, want, rtol=2 ** -7, atol=1e-2)


def test_merging_by_name_an_adapter_that_sits_on_16_bit_layers_alone():
    """merge_and_unload(adapter_names=['b']) merges 'b' (on the 16-bit head only), whatever adapter is active on the
    nibble layers: a nibble layer refuses only the merge of an adapter it holds."""
    torch.manual_seed(33)
    adapted = peft.get_peft_model(_Net(), lora_config(r=4, target_modules=["proj"]))
    adapted.add_adapter("b", lora_config(r=4, lora_alpha=8, target_modules=["head"]))
    head = adapted.base_model.model.head
    with torch.no_grad():
        head.lora_B["b"].weight.normal_()
    weight = head.base_layer.weight.detach().double() + 2.0 * (head.lora_B["b"].weight @ head.lora_A["b"].weight).double()
    bias = head.base_layer.bias.detach().double()
    assert adapted.active_adapters == ["default"]
    merged = adapted.merge_and_unload(adapter_names=["b"])
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(merged(x).double(), merged.proj(x).double() @ weight.T + bias, rtol=1e-5, atol=1e-5)


def test_adapter_names_of_another_length_than_the_batch_are_refused():
    """peft's check of a mixed batch's adapter_names: skipped, rows past the names' ran without their adapter."""
    adapted = peft.get_peft_model(_Net(), lora_config(r=4, target_modules=["proj"]))
    with pytest.raises(ValueError, match="Length of `adapter_names` should be the same as the number of inputs"):
        adapted.base_model.model.proj(torch.randn(3, 64), adapter_names=["default", "__base__"])
