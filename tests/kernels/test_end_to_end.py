"""End to end: clipped sums with the Triton kernels equal those of the torch references.

Each model runs ``clipped_gradients`` twice on the same inputs: once with every op dispatched to
its kernel (TRITON_INTERPRET=1 on the CPU, or CUDA), once with PDPFAST_DISABLE_TRITON=1.
"""
import pytest
import torch
from torch import nn

import pdpfast
from pdpfast.functional import clipped_gradients
from pdpfast.ops import dispatch


def _mlp():
    return nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 3)), (torch.randn(4, 6),), 3


def _cnn():
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, stride=2, groups=2), nn.Flatten(), nn.Linear(36, 3))
    return model, (torch.randn(3, 2, 8, 8),), 3


def _transformer():
    from bench.models import TinyTransformer

    return TinyTransformer(vocab=20, d=16, layers=1, heads=2, seq=7, classes=3), (torch.randint(0, 20, (3, 7)),), 3


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=23, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    model.config._attn_implementation = "eager"
    return model, (torch.randint(0, 23, (2, 6)),), None


MODELS = {"mlp": _mlp, "groupnorm-cnn": _cnn, "transformer": _transformer, "gpt2-tied": _gpt2}


def _loss_fn(classes):
    if classes is None:  # language model: per-sample mean token loss on the logits
        return lambda out: out.logits.float().pow(2).mean((1, 2))
    return lambda out: nn.functional.cross_entropy(out, torch.arange(out.shape[0], device=out.device) % classes,
                                                  reduction="none")


@pytest.mark.parametrize("mode,clipping", [("bk", "flat"), ("ghost", "flat"), ("bk", "per_layer")])
@pytest.mark.parametrize("name", list(MODELS))
def test_engine_with_kernels_matches_reference_math(name, mode, clipping, monkeypatch, device):
    torch.manual_seed(0)
    model, inputs, classes = MODELS[name]()
    model = pdpfast.nn.convert(model.to(device))
    inputs = tuple(t.to(device) for t in inputs)
    B = inputs[0].shape[0]
    clip_norms = torch.linspace(0.05, 2.0, B)  # the engine moves bounds to the device once per batch
    assert dispatch.use_triton(inputs[0].float())

    def run():
        return clipped_gradients(model, _loss_fn(classes), *inputs, clip_norms=clip_norms, mode=mode,
                                 clipping=clipping)

    fast = run()
    monkeypatch.setenv("PDPFAST_DISABLE_TRITON", "1")
    reference = run()
    torch.testing.assert_close(fast.norms, reference.norms, rtol=1e-4, atol=1e-6)
    for key in reference.grads:
        torch.testing.assert_close(fast.grads[key], reference.grads[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_rounding_bound_with_kernels_matches_reference_math_in_bf16(name, clipping, monkeypatch, device):
    """bf16: the norm kernels' fused rounding bound (rank-one heads, Gram-path sequences, stacked
    calls) gives the state the ρ_i and clipped sums the torch references give."""
    from pdpfast.clipping import ClippingState

    torch.manual_seed(0)
    model, inputs, classes = MODELS[name]()
    model = pdpfast.nn.convert(model.to(device, torch.bfloat16))
    inputs = tuple(t.to(device, torch.bfloat16) if t.is_floating_point() else t.to(device) for t in inputs)
    B = inputs[0].shape[0]
    loss_fn = _loss_fn(classes)

    def run():
        state = ClippingState(model, clipping=clipping)
        with state.attached():
            state.begin_batch(torch.linspace(0.05, 2.0, B))
            loss_fn(model(*inputs).float()).sum().backward()
            out = state.last_norms, state.last_rounding, {n: p.grad.clone() for n, p in model.named_parameters()}
            state.end_draw()
        model.zero_grad(set_to_none=True)
        return out

    norms, rho, grads = run()
    monkeypatch.setenv("PDPFAST_DISABLE_TRITON", "1")
    ref_norms, ref_rho, ref_grads = run()
    torch.testing.assert_close(norms, ref_norms, rtol=1e-4, atol=1e-6)
    if clipping == "flat":
        assert rho is not None and (rho > 0).all()
        torch.testing.assert_close(rho, ref_rho, rtol=1e-4, atol=0)
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-2, atol=1e-3, msg=key)
