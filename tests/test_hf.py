"""Hugging Face models and PEFT with te.Linear (issue 20). transformers and peft are test-only
dependencies (make test installs them where the package index is reachable); without them these
tests skip.

A Llama built from a small LlamaConfig and converted with te.convert: its
gradient_checkpointing_enable() (activation_checkpointing_enable() in newer transformers;
use_reentrant True and False) gives gradients bit-identical to the same steps without it under
DelayedScaling and NVFP4 (every recipe under checkpointing: tests/test_checkpoint.py); it trains
and generates. PEFT's LoRA wraps
te.Linear (a torch.nn.Linear) and trains under te.autocast, the base layer running quantized.
The code under test: python/tequant/checkpoint.py, convert.py, linear.py.
"""
import copy

import pytest
import torch

import tequant as te
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling, NVFP4BlockScaling)

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])]
RECIPES = {
    "delayed": DelayedScaling(),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),
}
VOCAB = 128


def llama(device):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device)
    te.convert(model)  # every projection and the LM head: all dims are multiples of 32
    return model


def train(model, recipe, device, steps=2):
    model.train()
    torch.manual_seed(7)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 21), device=device)
        with te.autocast(recipe=recipe):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        out += [loss.detach()] + grads
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.05 * p.grad
                    p.grad = None
    return out


# DelayedScaling (amaxes recorded once per forward, the recompute on its forward's scales) and
# NVFP4 (stochastic rounding replayed in the recompute): what HF's switch must carry to te.Linear.
# Every recipe under torch.utils.checkpoint in both modes, and checkpoint_wrapper in both
# implementations, bit-identical to no checkpointing: tests/test_checkpoint.py.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("name", ["delayed", "nvfp4"])
def test_gradient_checkpointing_enable_bit_identical(name, use_reentrant, device):
    model = llama(device)
    assert type(model.model.layers[0].mlp.down_proj) is te.Linear
    want = train(copy.deepcopy(model), RECIPES[name], device)
    twin = copy.deepcopy(model)
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(twin, "activation_checkpointing_enable"):  # transformers >= 5.2x's name for it
        twin.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        twin.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    twin.config.use_cache = False
    got = train(twin, RECIPES[name], device)
    assert len(got) == len(want) > 2 * 20
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"tensor {i} differs"


def test_trains_and_generates():
    model = llama("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.arange(32).repeat(4, 1) % VOCAB  # a sequence to memorize
    losses = []
    for _ in range(30):
        with te.autocast(recipe=RECIPES["mxfp8"]):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses
    model.eval()
    prompt = ids[:1, :4]
    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=6, do_sample=False)
        with te.autocast(recipe=RECIPES["mxfp8"]):
            quantized = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert plain.shape == quantized.shape == (1, 10)
    assert torch.equal(plain[0, :4], prompt[0])


def test_peft_lora_trains_on_te_linear():
    peft = pytest.importorskip("peft", reason="peft is not installed")
    torch.manual_seed(0)
    base = torch.nn.Sequential(te.Linear(64, 128), torch.nn.GELU(), te.Linear(128, 64))
    frozen = [(p, p.detach().clone()) for p in base.parameters()]
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["0", "2"],
                                                      lora_dropout=0.0, init_lora_weights=False))
    fc1 = model.base_model.model[0]
    assert type(fc1.base_layer) is te.Linear
    recipe = RECIPES["current"]
    x, target = torch.randn(32, 64), torch.randn(32, 64)
    # the adapted layer: the base te.Linear's quantized output plus the high-precision adapter
    with te.autocast(recipe=recipe):
        got = fc1(x)
        want = fc1.base_layer(x) + fc1.lora_B["default"](fc1.lora_A["default"](x)) * \
            fc1.scaling["default"]
        base_out = fc1.base_layer(x)
    assert torch.equal(got, want)
    assert not torch.equal(base_out, torch.nn.functional.linear(x, fc1.base_layer.weight,
                                                                fc1.base_layer.bias))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(25):
        with te.autocast(recipe=recipe):
            loss = (model(x) - target).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0], losses
    for p, before in frozen:  # the te.Linear weights are frozen; only the adapters trained
        assert not p.requires_grad and torch.equal(p, before)
