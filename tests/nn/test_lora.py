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
    with pytest.raises(ValueError, match="DoRA"):
        peft.get_peft_model(copy.deepcopy(quantized), lora_config(r=4, target_modules=TARGETS, use_dora=True))
    adapted = peft.get_peft_model(quantized, lora_config(r=4, target_modules=TARGETS))
    with pytest.raises(ValueError, match="cannot be merged into a nibble layer's INT4 weights"):
        adapted.merge_and_unload()
