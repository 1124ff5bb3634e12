"""``nn.EmbeddingBag`` (``pdpfast.nn.DPEmbeddingBag``) against the float64 oracle: sum and mean,
``padding_idx``, ``per_sample_weights``, repeated ids in a bag, 2-D input and 1-D input with
offsets (one bag per sample); mode "max" is refused by name."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pdpfast

B, L, V, D = 5, 6, 11, 4


class Bags(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, **options)
        self.head = nn.Linear(D, 3)

    def forward(self, ids, weights=None):
        return self.head(torch.tanh(self.bag(ids, per_sample_weights=weights)))


def ce_loss(logits, labels):
    return nn.functional.cross_entropy(logits, labels, reduction="none")


def ids_with_repeats():
    ids = torch.randint(0, V, (B, L))
    ids[:, 1] = ids[:, 0]  # a repeated id in every bag
    ids[0, :] = 0          # a bag of padding only (padding_idx=0 cases)
    return ids


CASES = {
    "sum": (dict(mode="sum"), False),
    "mean": (dict(mode="mean"), False),
    "mean-padding": (dict(mode="mean", padding_idx=0), False),
    "sum-padding-weights": (dict(mode="sum", padding_idx=0), True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_embedding_bag_matches_oracle(name, style, oracle):
    options, weighted = CASES[name]
    torch.manual_seed(1)
    reference = Bags(**options).double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    assert isinstance(model.bag, pdpfast.nn.DPEmbeddingBag)
    inputs = (ids_with_repeats(),) + ((torch.rand(B, L, dtype=torch.float64),) if weighted else ())
    result, _ = oracle.check(model, ce_loss, inputs, (torch.randint(0, 3, (B,)),), reference=reference,
                             method="loop", **style)
    assert "bag.weight" in result.grads


@pytest.mark.parametrize("clipped", [True, False], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("name", list(CASES))
def test_one_bag_and_no_bag(name, clipped, style, oracle):
    """B = 1 against the oracle, and B = 0: no norm, every gradient zero."""
    options, weighted = CASES[name]
    reference = Bags(**options).double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    ids = ids_with_repeats()[1:]  # (row 0 is all padding)
    inputs = (ids,) + ((torch.rand(B - 1, L, dtype=torch.float64),) if weighted else ())
    targets = (torch.randint(0, 3, (B - 1,)),)
    oracle.check_one(model, ce_loss, inputs, targets, reference=reference, method="loop", clipped=clipped, **style)
    oracle.check_empty(model, ce_loss, inputs, targets, **style)


@pytest.mark.parametrize("include_last_offset", [False, True])
def test_offsets_input_equals_the_two_dimensional_layout(include_last_offset, oracle):
    torch.manual_seed(2)
    model = pdpfast.nn.convert(Bags(mode="mean", include_last_offset=include_last_offset).double())
    lengths = torch.tensor([3, 0, 1, 4, 2])
    flat = torch.randint(1, V, (int(lengths.sum()),))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    if include_last_offset:
        offsets = torch.cat([offsets, lengths.sum().view(1)])
    padded = torch.zeros(B, int(lengths.max()), dtype=torch.long)  # padding_idx-free: pad by weight 0
    weights = torch.zeros(B, int(lengths.max()), dtype=torch.float64)
    for i, (start, n) in enumerate(zip(offsets.tolist(), lengths.tolist())):
        padded[i, :n] = flat[start:start + n]
        weights[i, :n] = 1.0 / max(n, 1)
    labels = torch.randint(0, 3, (B,))
    bounds = torch.full((B,), 0.05, dtype=torch.float64)

    bag_model = lambda ids, offs: model.head(torch.tanh(model.bag(ids, offs)))  # noqa: E731
    with torch.no_grad():
        model.eval()
        expected_out = model.head(torch.tanh(nn.functional.embedding_bag(padded, model.bag.weight, mode="sum",
                                                                          per_sample_weights=weights)))
        torch.testing.assert_close(bag_model(flat, offsets), expected_out, rtol=1e-12, atol=1e-12)
        model.train()

    state = pdpfast.clipping.ClippingState(model)  # the 1-D form, driven by hand
    with state.attached():
        state.begin_batch(bounds)
        ce_loss(bag_model(flat, offsets), labels).sum().backward()
    offset_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norms = state.last_norms.clone()
    model.zero_grad()
    sum_model = pdpfast.nn.convert(Bags(mode="sum").double())
    sum_model.load_state_dict(model.state_dict())
    result = oracle.run(sum_model, ce_loss, (padded, weights), (labels,), clip_norms=bounds)
    oracle.assert_close(norms, result.norms, "norms")
    for name, g in result.grads.items():
        oracle.assert_close(offset_grads[name], g, name)


def test_max_mode_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="mode='max'"):
        pdpfast.nn.convert(Bags(mode="max"))
    model = pdpfast.nn.convert(Bags(mode="mean").double())
    ids = torch.randint(0, V, (B, L))
    with pytest.raises(ValueError, match="only supported for mode='sum'"):
        pdpfast.functional.clipped_gradients(model, lambda out: out.sum(1), ids,
                                             torch.rand(B, L, dtype=torch.float64), clip_norms=torch.ones(B))


def test_two_dimensional_bags_clip_without_a_host_synchronisation():
    """Bags given as (B, L) ids have static shapes end to end: norms and clipped sums never wait for
    the device (1-D input with offsets reads its longest bag once, in the forward)."""
    from pdpfast.graphs import no_host_sync

    torch.manual_seed(2)
    model = pdpfast.nn.convert(Bags(mode="mean", padding_idx=0))
    state = pdpfast.clipping.ClippingState(model)
    state.attach()
    ids, labels = ids_with_repeats(), torch.randint(0, 3, (B,))
    state.begin_batch(torch.ones(B), loss_scale=B)  # the host's bounds, checked on the host
    with no_host_sync():
        ce_loss(model(ids), labels).mean().backward()
    assert model.bag.weight.grad is not None and torch.isfinite(model.bag.weight.grad).all()
    state.detach()


def private_forward(model, ids, offsets, batch):
    """``model.bag(ids, offsets)`` in a private batch of ``batch`` samples (the 1-D form, driven by hand)."""
    state = pdpfast.clipping.ClippingState(model)
    with state.attached():
        state.begin_batch(torch.ones(batch, dtype=model.bag.weight.dtype))
        return model.bag(ids, offsets)


@pytest.mark.parametrize("include_last_offset,offsets,message", [
    (False, torch.tensor([2, 4]), r"offsets must start at 0 .*got offsets\[0\] = 2"),
    (True, torch.tensor([2, 4, 6]), r"offsets must start at 0 .*got offsets\[0\] = 2"),
    (False, torch.tensor([0, 4, 2]), r"offsets must be non-decreasing .*got a step of -2"),
    (True, torch.tensor([0, 4, 2, 6]), r"offsets must be non-decreasing .*got a step of -2"),
    (False, torch.tensor([0, 2, 9]), r"offsets must be at most len\(input\) = 6, got offsets\[-1\] = 9"),
    (True, torch.tensor([0, 2, 7]), r"offsets must be at most len\(input\) = 6, got offsets\[-1\] = 7"),
    (True, torch.tensor([0, 2, 4]), r"offsets must end with len\(input\) = 6 with include_last_offset=True"),
    (True, torch.tensor([], dtype=torch.long), r"offsets must hold at least one value with include_last_offset"),
    (False, torch.tensor([[0, 2]]), r"offsets must be a 1-D int64 or int32 tensor .*got a 2-D torch.int64"),
    (False, torch.tensor([0.0, 2.0]), r"offsets must be a 1-D int64 or int32 tensor .*got a 1-D torch.float32"),
    (False, [0, 2], r"offsets must be a 1-D int64 or int32 tensor .*got list"),
])
def test_offsets_that_do_not_name_bags_of_the_input_are_refused_by_name(include_last_offset, offsets, message):
    """Offsets not starting at 0 used to give other bags than they name, silently; decreasing ones an
    unclear error from inside the layout. torch refuses the first (and reads a smaller last offset with
    include_last_offset differently in float32 and float64): the private forward refuses all of them."""
    model = pdpfast.nn.convert(Bags(mode="sum", include_last_offset=include_last_offset).double())
    batch = len(offsets) - int(include_last_offset)
    with pytest.raises(ValueError, match=message):
        private_forward(model, torch.arange(1, 7), offsets, max(batch, 0))


@pytest.mark.parametrize("include_last_offset", [False, True])
@pytest.mark.parametrize("lengths", [[0, 3, 0], [0, 0]], ids=["empty-first-and-last", "all-empty"])
def test_private_forward_equals_torch_for_offsets_with_empty_bags(lengths, include_last_offset):
    """Empty bags anywhere, every bag empty (a (B, 1) layout of weight 0) and int32 offsets: the
    private forward gives the bags torch's own forward gives."""
    torch.manual_seed(4)
    model = pdpfast.nn.convert(Bags(mode="mean", include_last_offset=include_last_offset).double())
    lengths = torch.tensor(lengths, dtype=torch.int32)
    ids = torch.randint(0, V, (int(lengths.sum()),))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0, dtype=torch.int32)])
    offsets = offsets if include_last_offset else offsets[:-1]
    private = private_forward(model, ids, offsets, len(lengths)).detach()
    with torch.no_grad():
        expected = model.eval().bag(ids, offsets)
    torch.testing.assert_close(private, expected, rtol=1e-12, atol=1e-12)
