"""``torch.compile`` over a private model: the step equals the eager one.

Dynamo cannot put a DP layer's backward hook (a pre-hook on the autograd node of the layer's output)
inside a compiled graph, so it breaks the graph at every DP layer and the layers run as in eager mode.
What must hold is that nothing is lost on the way: were a compiled forward to drop the hooks, the
clipping state would see no layer call and the step would release noise alone (or, with parameters
that are not detached, unclipped gradients). The README ("On a GPU") says what compiling buys: nothing
for the DP layers; the captured step (``cuda_graph=True``) is the way to a host-free step.
"""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pdpfast


def _steps(compiled: bool, clipping: str, steps: int = 3) -> list[torch.Tensor]:
    """The parameters before the first and after each of ``steps`` private steps (noise on, a fixed seed)."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))
    engine = pdpfast.PrivacyEngine(seed=11)
    clip_norms = torch.linspace(0.05, 0.5, 48)  # per-record bounds, small enough that every record is clipped
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=DataLoader(data, 12),
        noise_multiplier=0.3, max_grad_norm=0.5, sample_rates=0.25, clip_norms=clip_norms, clipping=clipping)
    forward = torch.compile(private) if compiled else private
    after = [torch.cat([p.detach().flatten() for p in model.parameters()]).clone()]
    for step, (x, y) in enumerate(loader):
        nn.functional.cross_entropy(forward(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        after.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())
        if step + 1 == steps:
            break
    return after


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_a_torch_compiled_private_model_takes_the_eager_models_clipped_noised_steps(clipping):
    eager, compiled = _steps(False, clipping), _steps(True, clipping)
    assert len(eager) == len(compiled) == 4
    for before, e, c in zip(eager, eager[1:], compiled[1:]):
        assert not torch.equal(e, before)  # each step moved the parameters
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


def test_compiled_autograd_refuses_a_private_backward_before_writing_any_gradient():
    """Compiled autograd cannot trace a DP layer's backward hook (a C++ hook without compiled-autograd
    support, ``csrc/hooks.cpp``; torch's own Python hook route stops at the end-of-backward callback):
    the backward raises, and no parameter holds an unclipped gradient."""
    enable = getattr(getattr(torch._dynamo, "compiled_autograd", None), "_enable", None)
    if enable is None:
        pytest.skip("this torch has no torch._dynamo.compiled_autograd._enable")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g))
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    engine = pdpfast.PrivacyEngine(seed=1)
    private, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, 8),
        noise_multiplier=0.0, max_grad_norm=1.0, sample_rates=0.5)
    x, y = next(iter(loader))
    with pytest.raises((NotImplementedError, RuntimeError, AssertionError)):
        with enable(torch.compile(backend="eager")):
            nn.functional.cross_entropy(private(x), y).backward()
    assert all(p.grad is None for p in model.parameters())
