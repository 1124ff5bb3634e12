"""``pdpfast.nn.convert``: in place, same Parameter objects, same outputs; clear refusals."""
from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import pdpfast.nn as pnn
from pdpfast.clipping import ClippingState
from pdpfast.functional import clipped_gradients
from pdpfast.nn import DPModule, convert, replace_batchnorm
from pdpfast.nn.convert import unsupported_modules

B = 4


def sq_loss(outputs, target):
    return 0.5 * (outputs - target).pow(2).flatten(1).sum(1)


def dp_modules(model):
    return [name for name, m in model.named_modules() if isinstance(m, DPModule)]


def mlp():
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


# ------------------------------------------------------------------------ in place, shared parameters


def test_convert_is_in_place_and_keeps_parameter_objects():
    model = mlp()
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    first = model[0]
    assert convert(model) is model
    assert model[0] is first and isinstance(first, nn.Linear) and isinstance(first, DPModule)
    assert all(p is params[n] for n, p in model.named_parameters())
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert dp_modules(model) == ["0", "2"]


def test_optimizer_built_before_conversion_still_steps():
    model = mlp().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    convert(model)
    x, t = torch.randn(B, 5, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = clipped_gradients(model, lambda out: sq_loss(out, t), x, clip_norms=torch.full((B,), 0.5))
    for n, p in model.named_parameters():
        p.grad = result.grads[n]
    optimizer.step()
    for n, p in model.named_parameters():
        assert result.grads[n].any()
        torch.testing.assert_close(p.detach(), before[n] - 0.1 * result.grads[n], rtol=0, atol=1e-15)


def test_convert_twice_is_a_no_op():
    model = convert(mlp())
    classes = [type(m) for m in model.modules()]
    convert(model)
    assert [type(m) for m in model.modules()] == classes


def test_convert_refuses_a_non_module():
    with pytest.raises(TypeError, match="model"):
        convert(lambda x: x)


# ------------------------------------------------------------------------ BatchNorm


def cnn_with_batchnorm(frozen=False):
    model = nn.Sequential(OrderedDict(
        features=nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten()),
        head=nn.Sequential(nn.Linear(8 * 5 * 5, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))))
    if frozen:
        model.features[1].requires_grad_(False)
        model.head[1].requires_grad_(False)
    return model


@pytest.mark.parametrize("frozen", [False, True])
def test_batchnorm_is_refused_by_path_with_groupnorm_advice(frozen):
    """BatchNorm mixes the samples of a batch (even with frozen affine parameters): refused."""
    model = cnn_with_batchnorm(frozen)
    with pytest.raises(ValueError) as error:
        convert(model)
    message = str(error.value)
    for expected in ("features.1 (BatchNorm2d)", "head.1 (BatchNorm1d)", "GroupNorm", "replace_batchnorm"):
        assert expected in message
    assert dp_modules(model) == []  # nothing changed on error


def test_replace_batchnorm_then_convert(oracle):
    model = cnn_with_batchnorm()
    params = {id(p) for n, p in model.named_parameters() if "features.1" not in n and "head.1" not in n}
    replace_batchnorm(model)
    assert not any(isinstance(m, _BatchNorm) for m in model.modules())
    assert isinstance(model.features[1], nn.GroupNorm) and model.features[1].num_channels == 8
    assert model.features[1].num_groups == 8 and model.head[1].num_groups == 2  # gcd(32, C)
    model = convert(model.double())
    assert params <= {id(p) for p in model.parameters()}
    assert set(dp_modules(model)) == {"features.0", "features.1", "head.0", "head.1", "head.2"}
    x, t = torch.randn(B, 3, 5, 5, dtype=torch.float64), torch.randn(B, 2, dtype=torch.float64)
    oracle.check(model, sq_loss, (x,), (t,))


# ------------------------------------------------------------------------ unsupported modules


class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.gain


class RNNHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(4, 4, batch_first=True, proj_size=2)

    def forward(self, x):
        return self.rnn(x)[0]


def test_unsupported_modules_are_all_listed_in_one_error():
    model = nn.Sequential(OrderedDict(
        proj=nn.Linear(4, 4),
        blocks=nn.ModuleList([nn.MultiheadAttention(4, 2, batch_first=True, add_bias_kv=True), RNNHead(),
                              Scale(4)])))
    with pytest.raises(ValueError) as error:
        convert(model)
    message = str(error.value)
    for path in ("blocks.0 (MultiheadAttention: add_bias_kv", "blocks.1.rnn (LSTM: proj_size",
                 "blocks.2 (Scale: gain)"):
        assert path in message
    assert "proj (Linear" not in message and "out_proj" not in message
    assert "requires_grad_(False)" in message
    assert dp_modules(model) == []  # nothing changed on error


def test_frozen_unsupported_modules_are_left_alone():
    model = nn.Sequential(nn.Linear(4, 4), Scale(4), nn.LSTM(4, 4, batch_first=True))
    model[1].requires_grad_(False)
    model[2].requires_grad_(False)
    convert(model)
    assert dp_modules(model) == ["0", "2"]  # a frozen LSTM becomes a DP LSTM that does no DP work


class LinearWithOwnForward(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class ShiftedPositions(nn.Embedding):  # as BART's and OPT's learned positions: ids computed in its forward
    def forward(self, ids):
        positions = torch.cumsum(ids != 0, dim=1) * (ids != 0)
        return super().forward(positions + 1) * 0.5


class LinearWithAParameterOfItsOwn(nn.Linear):
    def __init__(self, *args):
        super().__init__(*args)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return super().forward(x) * self.gain


class LinearUsingItsWeightDirectly(nn.Linear):
    def forward(self, x):  # never reaches the private forward
        return F.linear(x, self.weight, self.bias)


class LinearWithExtraMethod(nn.Linear):
    def describe(self):
        return f"{self.in_features}->{self.out_features}"


class _TokensAndPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(9, 4, padding_idx=0), ShiftedPositions(8, 4)
        self.head = LinearWithOwnForward(4, 2)

    def forward(self, ids):
        return self.head(torch.tanh(self.tokens(ids) + self.positions(ids))).sum(1)


def test_subclass_with_its_own_forward_runs_it_around_the_private_forward(oracle):
    """A subclass's own forward runs, and its ``super().forward`` is the DP layer's private forward:
    the per-sample gradients are exact whatever it computes around that call."""
    reference = _TokensAndPositions().double()
    model = convert(copy.deepcopy(reference))
    assert dp_modules(model) == ["tokens", "positions", "head"]
    assert isinstance(model.positions, ShiftedPositions) and isinstance(model.head, LinearWithOwnForward)
    ids = torch.randint(1, 9, (B, 6))
    ids[0, 4:] = 0
    ids[2, 2:] = 0
    t = torch.randn(B, 2, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))
    oracle.check(model, sq_loss, (ids,), (t,), reference=reference)


def test_subclass_with_its_own_forward_and_a_parameter_of_its_own_is_refused_naming_it():
    model = nn.Sequential(nn.Linear(3, 4), LinearWithAParameterOfItsOwn(4, 2))
    with pytest.raises(ValueError, match=r"1 \(LinearWithAParameterOfItsOwn: gain: a subclass of nn.Linear with its "
                                         r"own forward and trainable parameters the Linear rule does not clip\)"):
        convert(model)
    assert dp_modules(model) == []


def test_subclass_whose_own_forward_bypasses_the_private_forward_is_refused_in_the_backward():
    model = convert(nn.Sequential(LinearUsingItsWeightDirectly(3, 2)))
    with pytest.raises(RuntimeError, match="ordinary, unclipped gradient .* own forward uses it without calling "
                                           r"super\(\).forward"):
        clipped_gradients(model, lambda out: out.sum(1), torch.randn(B, 3), clip_norms=torch.ones(B))


class FixedPositions(nn.Embedding):  # Blenderbot's and LED's: positions of the whole batch, broadcast afterwards
    def forward(self, ids):
        return super().forward(torch.arange(ids.shape[1], device=ids.device))


def test_subclass_whose_own_forward_gives_its_layer_a_1d_input_is_refused_even_when_its_length_is_the_batch():
    """Rows of a 1-D input would be clipped as records: with T = B, each would be one position's
    gradient summed over the records (Blenderbot's learned positions, which convert refused before)."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(9, 4), FixedPositions(8, 4)

        def forward(self, ids):
            return (self.tokens(ids) + self.positions(ids)).sum((1, 2))

    model = convert(Model())
    for T in (B, B + 1):
        with pytest.raises(ValueError, match=r"positions \(FixedPositions, whose own forward calls the layer's\) gave "
                                             rf"the layer a 1-D input of shape \({T},\)"):
            clipped_gradients(model, lambda out: out, torch.randint(0, 9, (B, T)), clip_norms=torch.ones(B))
    model.positions.requires_grad_(False)  # frozen after convert: nothing to clip
    frozen_before = Model()
    frozen_before.positions.requires_grad_(False)  # left as it is by convert
    for trained in (model, convert(frozen_before)):
        assert set(clipped_gradients(trained, lambda out: out, torch.randint(0, 9, (B, B)),
                                     clip_norms=torch.ones(B)).grads) == {"tokens.weight"}


class LinearCallingItsLayerByKeyword(nn.Linear):
    def forward(self, x):
        return super().forward(input=x) * 2  # torch's name for the argument


class RMSNormByHand(nn.RMSNorm):  # recognized by what it computes (DPRMSNormForm), its forward run privately
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class InstanceNormPlusOne(nn.InstanceNorm2d):  # a DP class shared by InstanceNorm1d/2d/3d
    def forward(self, x):
        return super().forward(x) + 1


class LinearWithAFrozenGain(LinearWithAParameterOfItsOwn):
    def __init__(self, *args):
        super().__init__(*args)
        self.gain.requires_grad_(False)


def _hf_conv1d_halved():  # a DP mixin (DPConv1D is not a subclass of Conv1D): joined to it first
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D

    class Conv1DHalved(conv1d):
        def forward(self, x):
            return super().forward(x) * 0.5
    return Conv1DHalved(2, 4)


@pytest.mark.parametrize("make", [lambda: LinearCallingItsLayerByKeyword(4, 2), lambda: RMSNormByHand(4, eps=1e-5),
                                  lambda: InstanceNormPlusOne(2, affine=True), lambda: LinearWithAFrozenGain(4, 2),
                                  _hf_conv1d_halved],
                         ids=["keyword", "rms-norm-form", "instance-norm", "frozen-gain", "hf-conv1d"])
def test_more_subclasses_with_their_own_forward_match_the_oracle(make, oracle):
    torch.manual_seed(0)
    layer = make()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(1.0, 0.5)
    if isinstance(layer, nn.InstanceNorm2d):
        reference, x = nn.Sequential(nn.Conv2d(3, 2, 3), layer).double(), torch.randn(B, 3, 6, 6, dtype=torch.float64)
    else:
        reference, x = nn.Sequential(nn.Linear(4, 4), layer).double(), torch.randn(B, 3, 4, dtype=torch.float64)
    model = convert(copy.deepcopy(reference))
    assert isinstance(model[1], DPModule) and isinstance(model[1], type(layer))
    assert isinstance(model[1], pnn.DPRMSNormForm) == isinstance(layer, RMSNormByHand)
    t = torch.randn_like(reference(x))
    for mode, clipping in (("bk", "flat"), ("ghost", "flat"), ("bk", "per_layer")):
        oracle.check(model, sq_loss, (x,), (t,), reference=reference, mode=mode, clipping=clipping)


class LinearWithAHelperNamedLikeTheDPLayers(nn.Linear):
    def _prepare(self, x):  # DPModule's name: first in the MRO, it would replace the private forward's
        return x * 2.0

    def forward(self, x):
        return super().forward(self._prepare(x))


def test_subclass_with_its_own_forward_and_a_method_named_like_the_dp_layers_is_refused():
    with pytest.raises(ValueError, match=r"0 \(LinearWithAHelperNamedLikeTheDPLayers: weight, bias; a subclass of "
                                         r"nn.Linear with its own forward that defines _prepare, which the private "
                                         r"forward of DPLinear uses: rename them\)"):
        convert(nn.Sequential(LinearWithAHelperNamedLikeTheDPLayers(3, 2)))


def test_frozen_subclass_with_its_own_forward_is_left_alone():
    model = nn.Sequential(nn.Linear(3, 4), LinearUsingItsWeightDirectly(4, 2).requires_grad_(False))
    convert(model)
    assert dp_modules(model) == ["0"] and type(model[1]) is LinearUsingItsWeightDirectly
    result = clipped_gradients(model, lambda out: out.sum(1), torch.randn(B, 3), clip_norms=torch.ones(B))
    assert set(result.grads) == {"0.weight", "0.bias"}


def test_subclass_keeping_forward_is_converted_and_keeps_its_class(oracle):
    reference = nn.Sequential(LinearWithExtraMethod(3, 4), nn.Tanh(), LinearWithExtraMethod(4, 2)).double()
    model = convert(copy.deepcopy(reference))
    assert isinstance(model[0], LinearWithExtraMethod) and isinstance(model[0], DPModule)
    assert model[0].describe() == "3->4"
    x, t = torch.randn(B, 3, dtype=torch.float64), torch.randn(B, 2, dtype=torch.float64)
    oracle.check(model, sq_loss, (x,), (t,), reference=reference)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_norm=1.0), "max_norm"),
    (dict(scale_grad_by_freq=True), "scale_grad_by_freq"),
    (dict(sparse=True), "sparse"),
])
def test_embedding_options_that_break_per_sample_clipping_are_refused(kwargs, match):
    model = nn.Sequential(OrderedDict(tokens=nn.Embedding(10, 4, **kwargs), head=nn.Linear(4, 2)))
    with pytest.raises(ValueError, match=match) as error:
        convert(model)
    assert "tokens (Embedding" in str(error.value)
    assert dp_modules(model) == []


def test_frozen_embedding_with_max_norm_is_refused():
    """max_norm rewrites table rows from the batch's tokens in every forward, frozen or not."""
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    with pytest.raises(ValueError, match="max_norm"):
        convert(model)


# ------------------------------------------------------------------------ DP layers built directly

# (DP layer built directly, a regex of the refusal: class, option and its value)
IGNORED_OPTIONS = {
    "attention-add_bias_kv": (lambda: pnn.DPMultiheadAttention(4, 2, add_bias_kv=True, batch_first=True),
                              r"DPMultiheadAttention: add_bias_kv=True is not supported; use add_bias_kv=False"),
    "attention-add_zero_attn": (lambda: pnn.DPMultiheadAttention(4, 2, add_zero_attn=True, batch_first=True),
                                r"DPMultiheadAttention: add_zero_attn=True is not supported"),
    "attention-kdim-vdim": (lambda: pnn.DPMultiheadAttention(4, 2, kdim=3, vdim=3, batch_first=True),
                            r"DPMultiheadAttention: kdim/vdim .*kdim=3, vdim=3, embed_dim=4"),
    "embedding-bag-max": (lambda: pnn.DPEmbeddingBag(10, 2, mode="max"),
                          r"DPEmbeddingBag: mode='max' is not supported.*use 'sum' or 'mean'"),
    "embedding-max_norm": (lambda: pnn.DPEmbedding(10, 2, max_norm=1.0),
                           r"DPEmbedding: max_norm=1.0 .*set max_norm=None"),
    "embedding-scale_grad_by_freq": (lambda: pnn.DPEmbedding(10, 2, scale_grad_by_freq=True),
                                     r"DPEmbedding: scale_grad_by_freq=True .*set scale_grad_by_freq=False"),
    "embedding-sparse": (lambda: pnn.DPEmbedding(10, 2, sparse=True),
                         r"DPEmbedding: sparse=True .*set sparse=False"),
    "instance-norm-running-stats": (lambda: pnn.DPInstanceNorm(3, affine=True, track_running_stats=True),
                                    r"DPInstanceNorm: track_running_stats=True .*set track_running_stats=False"),
    "lstm-proj_size": (lambda: pnn.DPLSTM(3, 4, proj_size=2, batch_first=True),
                       r"DPLSTM: proj_size=2 .*use proj_size=0"),
}


@pytest.mark.parametrize("name", list(IGNORED_OPTIONS))
def test_a_dp_module_built_directly_with_an_option_its_private_forward_ignores_is_refused(name):
    """convert refuses these options on torch modules; a DP class built directly skipped that check,
    and its private forward ignored them (a clipped gradient of another function than the model's)."""
    make, match = IGNORED_OPTIONS[name]
    model = nn.Sequential(OrderedDict(layer=make()))
    with pytest.raises(ValueError, match="layer \\(" + match):
        ClippingState(model)  # the route of clipped_gradients and make_private, converted or not
    with pytest.raises(ValueError, match="layer \\(" + match):
        convert(model)  # convert checks the DP layers it meets too
    assert unsupported_modules(model) != []
    assert dp_modules(model) == ["layer"]  # nothing changed on error (an attention's out_proj stays torch's)


def test_a_dp_attention_built_directly_with_add_bias_kv_is_refused_before_any_gradient():
    """The probe's route: bias_k / bias_v got no gradient and the private output differed from eval."""
    x = torch.randn(3, 4, 4)
    with pytest.raises(ValueError, match="add_bias_kv=True"):
        clipped_gradients(pnn.DPMultiheadAttention(4, 2, add_bias_kv=True, batch_first=True),
                          lambda out: out[0].pow(2).sum((1, 2)), x, x, x, clip_norms=torch.ones(3))


def test_a_dp_module_changed_after_conversion_to_an_option_it_ignores_is_refused():
    model = convert(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)))
    ClippingState(model)
    model[0].max_norm = 1.0
    with pytest.raises(ValueError, match=r"0 \(DPEmbedding: max_norm=1.0"):
        ClippingState(model)


REPARAMETRIZED = {
    "weight_norm-hook": (lambda m: torch.nn.utils.weight_norm(m), "weight is recomputed by torch.nn.utils.weight_norm",
                         lambda m: torch.nn.utils.remove_weight_norm(m)),
    "spectral_norm-hook": (lambda m: torch.nn.utils.spectral_norm(m),
                           "weight is recomputed by torch.nn.utils.spectral_norm",
                           lambda m: torch.nn.utils.remove_spectral_norm(m)),
    "weight_norm-parametrize": (lambda m: torch.nn.utils.parametrizations.weight_norm(m),
                                "weight parametrized with torch.nn.utils.parametrize",
                                lambda m: torch.nn.utils.parametrize.remove_parametrizations(m, "weight")),
    "orthogonal-parametrize": (lambda m: torch.nn.utils.parametrizations.orthogonal(m),
                               "weight parametrized with torch.nn.utils.parametrize",
                               lambda m: torch.nn.utils.parametrize.remove_parametrizations(m, "weight")),
}


@pytest.mark.filterwarnings("ignore:.*is deprecated in favor of:FutureWarning")
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
@pytest.mark.parametrize("name", list(REPARAMETRIZED))
def test_a_reparametrized_layer_is_refused_by_name_frozen_or_not(name, frozen, oracle):
    """A layer whose weight its forward recomputes (weight norm, spectral norm, parametrize) has no
    registered ``weight``: every private forward failed with ``KeyError: 'weight'``, also after
    following the advice to freeze the parametrization's parameters. Refused by path and cause, as a
    torch module and as a DP layer reparametrized after conversion; folded in, it trains exactly."""
    reparametrize, match, fold = REPARAMETRIZED[name]
    model = nn.Sequential(OrderedDict(proj=nn.Linear(4, 4), head=reparametrize(nn.Linear(4, 4)))).double()
    if frozen:
        for n, p in model.head.named_parameters():
            p.requires_grad_(n == "bias")
    with pytest.raises(ValueError, match=r"head \(\w*Linear: " + match):
        convert(model)
    assert dp_modules(model) == []  # nothing changed on error
    fold(model.head)
    reference = copy.deepcopy(model)
    convert(model)
    x, t = torch.randn(B, 4, dtype=torch.float64), torch.randn(B, 4, dtype=torch.float64)
    oracle.check(model, sq_loss, (x,), (t,), reference=reference)
    reparametrize(model.head)  # after conversion: the clipping state refuses it
    with pytest.raises(ValueError, match=r"head \(\w*Linear: " + match):
        ClippingState(model)


def test_a_lazy_layer_is_refused_until_initialized():
    model = nn.Sequential(nn.LazyLinear(3))
    with pytest.raises(ValueError, match=r"0 \(LazyLinear: uninitialized \(lazy\) parameters weight, bias: "
                                         r"initialize it with a forward pass first, or use nn.Linear"):
        convert(model)
    assert dp_modules(model) == []
    model(torch.randn(B, 5))  # torch turns it into an nn.Linear(5, 3)
    assert isinstance(convert(model)[0], pnn.DPLinear)


def test_a_correctly_built_dp_module_built_directly_trains_and_equals_the_oracle(oracle):
    """DP layers built directly (no convert) train through clipped_gradients, exact per sample."""
    model = nn.Sequential(pnn.DPEmbedding(11, 5, padding_idx=3), pnn.DPLinear(5, 2)).double()
    ids, t = torch.randint(0, 11, (B, 7)), torch.randn(B, 7, 2, dtype=torch.float64)
    oracle.check(model, sq_loss, (ids,), (t,))


# ------------------------------------------------------------------------ forward parity

PARITY_LAYERS = {
    "linear-4d": lambda: (nn.Linear(6, 5), torch.randn(B, 2, 3, 6)),
    "conv1d-same-even": lambda: (nn.Conv1d(2, 3, 4, padding="same"), torch.randn(B, 2, 9)),
    "conv1d-same-even-dilation3": lambda: (nn.Conv1d(2, 3, 4, padding="same", dilation=3), torch.randn(B, 2, 12)),
    "conv1d-reflect": lambda: (nn.Conv1d(2, 3, 3, padding=2, padding_mode="reflect"), torch.randn(B, 2, 7)),
    "conv1d-circular": lambda: (nn.Conv1d(2, 4, 3, padding=1, groups=2, padding_mode="circular"),
                                torch.randn(B, 2, 6)),
    "conv2d-same-odd": lambda: (nn.Conv2d(2, 4, 3, padding="same", dilation=2), torch.randn(B, 2, 8, 9)),
    "conv2d-same-even": lambda: (nn.Conv2d(2, 3, (2, 4), padding="same"), torch.randn(B, 2, 7, 8)),
    "conv2d-valid": lambda: (nn.Conv2d(3, 4, (2, 3), stride=(2, 1), padding="valid"), torch.randn(B, 3, 7, 6)),
    "conv2d-reflect": lambda: (nn.Conv2d(2, 3, 3, padding=(1, 2), padding_mode="reflect"), torch.randn(B, 2, 6, 5)),
    "conv2d-circular": lambda: (nn.Conv2d(2, 3, 3, stride=2, padding=(2, 1), padding_mode="circular"),
                                torch.randn(B, 2, 7, 6)),
    "conv2d-replicate": lambda: (nn.Conv2d(2, 3, 2, padding=1, padding_mode="replicate"), torch.randn(B, 2, 5, 6)),
    "conv2d-depthwise": lambda: (nn.Conv2d(4, 8, 3, groups=4, padding=1, bias=False), torch.randn(B, 4, 5, 5)),
    "embedding-padding": lambda: (nn.Embedding(11, 5, padding_idx=3), torch.randint(0, 11, (B, 7))),
    "layernorm": lambda: (nn.LayerNorm((3, 4)), torch.randn(B, 5, 3, 4)),
    "groupnorm": lambda: (nn.GroupNorm(2, 6), torch.randn(B, 6, 4, 5)),
    "rmsnorm": lambda: (nn.RMSNorm(4), torch.randn(B, 3, 4)),
}


@pytest.mark.parametrize("name", list(PARITY_LAYERS))
def test_converted_layer_computes_the_same_outputs(name):
    layer, x = PARITY_LAYERS[name]()
    layer = layer.double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    x = x.double() if x.is_floating_point() else x
    model = convert(copy.deepcopy(layer))
    expected = layer(x)
    seen = []

    def capture(outputs):  # the private forward's outputs
        seen.append(outputs.detach().clone())
        return outputs.pow(2).flatten(1).sum(1)

    clipped_gradients(model, capture, x, clip_norms=torch.ones(B))
    torch.testing.assert_close(seen[0], expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model(x), expected, rtol=1e-12, atol=1e-12)  # plain (no batch attached)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), layer.eval()(x), rtol=1e-12, atol=1e-12)
    # the ordinary, non-private backward still gives the original's gradients
    model.train()
    layer.train()
    model.zero_grad()
    model(x).pow(2).sum().backward()
    layer(x).pow(2).sum().backward()
    for (n, p), q in zip(model.named_parameters(), layer.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=n)


# ------------------------------------------------------------------------ in-place activations


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.fc1 = nn.Linear(4 * 4 * 4, 6)
        self.fc2 = nn.Linear(6, 3)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.act(self.conv(x))          # in place right on a DP layer's output
        h = self.norm(h)
        F.relu_(h)
        h = self.fc1(h.flatten(1))
        h.add_(1.0).relu_()
        return self.fc2(h)


@pytest.mark.parametrize("mode,clipping", [("bk", "flat"), ("ghost", "flat"), ("bk", "per_layer")])
def test_in_place_relu_after_dp_layers(mode, clipping, oracle):
    reference = InPlace().double()
    model = convert(copy.deepcopy(reference))
    x, t = torch.randn(B, 2, 4, 4, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    oracle.check(model, sq_loss, (x,), (t,), reference=reference, mode=mode, clipping=clipping)


# ------------------------------------------------------------------------ Hugging Face Conv1D


def test_hf_conv1d_is_converted(oracle):
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    reference = nn.Sequential(Conv1D(5, 4), nn.Tanh(), Conv1D(3, 5)).double()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_()
    model = convert(copy.deepcopy(reference))
    assert isinstance(model[0], Conv1D) and isinstance(model[0], DPModule)
    x, t = torch.randn(B, 6, 4, dtype=torch.float64), torch.randn(B, 6, 3, dtype=torch.float64)
    for kwargs in (dict(mode="bk"), dict(mode="ghost"), dict(clipping="per_layer")):
        oracle.check(model, sq_loss, (x,), (t,), reference=reference, **kwargs)
        for clipped in (True, False):
            oracle.check_one(model, sq_loss, (x,), (t,), reference=reference, clipped=clipped, **kwargs)
        oracle.check_empty(model, sq_loss, (x,), (t,), **kwargs)


def test_instance_norm_with_running_statistics_is_refused():
    """Running statistics would be updated from the batch's data outside any accounting."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.InstanceNorm2d(3, affine=True, track_running_stats=True))
    with pytest.raises(ValueError, match="track_running_stats=False"):
        convert(model)


def test_conv3d_and_instance_norm_convert_in_place():
    model = nn.Sequential(nn.Conv3d(2, 3, 2), nn.InstanceNorm3d(3, affine=True), nn.InstanceNorm1d(3))
    from pdpfast.nn import DPConv3d, DPInstanceNorm

    params = list(model.parameters())
    convert(model)
    assert isinstance(model[0], DPConv3d) and isinstance(model[1], nn.InstanceNorm3d)
    assert isinstance(model[1], DPInstanceNorm)
    assert all(a is b for a, b in zip(params, model.parameters()))


# ------------------------------------------------------------------------ an RMSNorm under another name


class CopiedRMSNorm(nn.Module):
    """Hugging Face's RMSNorm as each model family copies it under its own name (``LlamaRMSNorm``,
    ``Qwen2RMSNorm``, ...): normalized in float32, then scaled in the input's dtype."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _normalized(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class OffsetWeightRMSNorm(nn.Module):  # Gemma's: the weight is an offset from 1; ε named eps; a helper method
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return (self._norm(x.float()) * (1.0 + self.weight.float())).type_as(x)


class MeanSubtractedRMSNorm(CopiedRMSNorm):  # a LayerNorm without bias (Cohere's)
    def forward(self, x):
        return _normalized(self, x - x.mean(-1, keepdim=True)) * self.weight


class SquaredWeightRMSNorm(CopiedRMSNorm):  # equal to an RMSNorm at a weight of ones only
    def forward(self, x):
        return _normalized(self, x) * self.weight * self.weight


class EpsilonIgnoredRMSNorm(CopiedRMSNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * self.weight


class GatedRMSNorm(CopiedRMSNorm):  # a second input the private forward would not pass on
    def forward(self, x, gate=None):
        out = _normalized(self, x) * self.weight
        return out if gate is None else out * F.silu(gate)


class TrainingDependentRMSNorm(CopiedRMSNorm):  # reads more of its module than weight and ε
    def forward(self, x):
        return _normalized(self, x) * self.weight * (1.0 if self.training else 2.0)


def _norm_between_linears(norm):
    model = nn.Sequential(nn.Linear(5, 6), norm, nn.Linear(6, 3)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


@pytest.mark.parametrize("norm_class", [CopiedRMSNorm, OffsetWeightRMSNorm])
@pytest.mark.parametrize("shape", [(B, 5), (B, 3, 5)], ids=["2d", "3d"])
def test_a_module_computing_an_rms_norm_under_another_name_is_converted_and_equals_the_oracle(
        norm_class, shape, oracle):
    reference = _norm_between_linears(norm_class(6, eps=0.3))
    model = convert(copy.deepcopy(reference))
    assert isinstance(model[1], pnn.DPRMSNormForm) and isinstance(model[1], norm_class)
    assert model[1].weight is not None and dp_modules(model) == ["0", "1", "2"]
    x, t = torch.randn(*shape, dtype=torch.float64), torch.randn(*shape[:-1], 3, dtype=torch.float64)
    for kwargs in (dict(mode="bk"), dict(mode="ghost"), dict(clipping="per_layer")):
        oracle.check(model, sq_loss, (x,), (t,), reference=reference, **kwargs)
        for clipped in (True, False):
            oracle.check_one(model, sq_loss, (x,), (t,), reference=reference, clipped=clipped, **kwargs)
        oracle.check_empty(model, sq_loss, (x,), (t,), **kwargs)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_an_rms_norm_under_another_name_in_a_low_precision_takes_rms_norms_route_and_stays_exact(
        dtype, tolerance, oracle, monkeypatch):
    """Below float64 the per-sample gradient comes from nn.RMSNorm's op (one launch on a GPU), not the
    module's own forward: equal to autograd's per-sample gradients of that forward to the dtype's
    rounding, and every record's clipped contribution within its bound."""
    import pdpfast.ops.norm

    op, calls = pdpfast.ops.norm.rms_norm_per_sample_grads, []
    monkeypatch.setattr(pdpfast.ops.norm, "rms_norm_per_sample_grads", lambda *a: calls.append(a) or op(*a))
    reference = _norm_between_linears(CopiedRMSNorm(6, eps=0.3)).to(dtype)
    model = convert(copy.deepcopy(reference))
    x, t = torch.randn(B, 3, 5, dtype=dtype), torch.randn(B, 3, 3, dtype=dtype)
    per_sample = oracle.per_sample_grads(reference.double(), sq_loss, (x.double(),), (t.double(),))
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values()))
    result = oracle.run(model, sq_loss, (x,), (t,), clip_norms=norms * 100)  # none clipped
    torch.testing.assert_close(result.norms.double(), norms, rtol=tolerance, atol=0)
    for name, g in per_sample.items():
        torch.testing.assert_close(result.grads[name].double(), g.sum(0), rtol=tolerance,
                                   atol=tolerance * float(g.abs().max()), msg=name)
    bounds = norms / 4  # every record clipped to a quarter of its norm
    result = oracle.run(model, sq_loss, (x,), (t,), clip_norms=bounds)
    assert torch.all(result.weights.double() * result.norms.double() <= bounds * (1 + 1e-6))
    assert calls and all(x.dtype == dtype for x, _, _ in calls)  # the op's route, in the model's dtype


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16)], ids=["fp32", "bf16", "fp32-weight-bf16-input"])
def test_an_rms_norm_under_another_name_keeps_its_own_forward_bit_for_bit(dtypes):
    weight_dtype, input_dtype = dtypes
    norm = CopiedRMSNorm(6, eps=1e-5).to(weight_dtype)
    with torch.no_grad():
        norm.weight.normal_()
    converted = convert(nn.Sequential(copy.deepcopy(norm)))
    x = torch.randn(B, 3, 6).to(input_dtype)
    seen = []

    def capture(outputs):  # the private forward's outputs
        seen.append(outputs.detach().clone())
        return outputs.float().pow(2).flatten(1).sum(1)

    clipped_gradients(converted, capture, x, clip_norms=torch.ones(B))
    expected = norm(x)
    assert torch.equal(seen[0], expected.detach()) and torch.equal(converted(x), expected)


@pytest.mark.parametrize("norm_class", [SquaredWeightRMSNorm, EpsilonIgnoredRMSNorm, MeanSubtractedRMSNorm,
                                        GatedRMSNorm, TrainingDependentRMSNorm])
def test_a_norm_computing_something_else_than_an_rms_norm_is_refused_by_name(norm_class):
    model = _norm_between_linears(norm_class(6, eps=0.3))
    assert unsupported_modules(model) == [f"1 ({norm_class.__name__}: weight)"]
    with pytest.raises(ValueError, match=rf"1 \({norm_class.__name__}: weight\)"):
        convert(model)
    assert dp_modules(model) == []  # nothing changed
    model[1].requires_grad_(False)  # frozen, it is left alone
    assert dp_modules(convert(model)) == ["0", "2"]


def test_an_rms_norm_with_more_than_its_weight_is_not_taken_for_one():
    norm = CopiedRMSNorm(6)
    norm.bias = nn.Parameter(torch.zeros(6))  # ignored by its forward, but trained by nobody
    assert unsupported_modules(nn.Sequential(norm)) == ["0 (CopiedRMSNorm: weight, bias)"]
    norm = CopiedRMSNorm(6)
    norm.variance_epsilon = "1e-6"
    assert unsupported_modules(nn.Sequential(norm)) == ["0 (CopiedRMSNorm: weight)"]
    norm = CopiedRMSNorm(6)
    norm.eps = 1e-6  # two ε: which one its forward reads, a probe could not tell
    assert unsupported_modules(nn.Sequential(norm)) == ["0 (CopiedRMSNorm: weight)"]


def test_hugging_faces_rms_norms_are_recognized_by_their_forward_not_their_names():
    pytest.importorskip("transformers")
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.llama4.modeling_llama4 import Llama4TextRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    model = nn.Sequential(LlamaRMSNorm(6), T5LayerNorm(6), GemmaRMSNorm(6), Llama4TextRMSNorm(6), CohereLayerNorm(6))
    assert unsupported_modules(model) == ["4 (CohereLayerNorm: weight)"]  # it subtracts the mean
    model[4].requires_grad_(False)
    convert(model)
    assert all(isinstance(m, pnn.DPRMSNormForm) for m in model[:4]) and not isinstance(model[4], DPModule)


@pytest.mark.parametrize("padding", [(2, 2), 2, (0, 1)])
def test_a_conv_padding_set_after_convert_is_the_one_its_forward_and_gradients_use(padding):
    """torch's zeros-mode forward pads with ``self.padding`` as it is at the call; before, the DP layer
    kept the padding it was built with (its output differed from torch's, silently)."""
    torch.manual_seed(0)
    plain = nn.Conv2d(3, 4, 3, padding=1)
    layer = pnn.convert(copy.deepcopy(plain))
    x = torch.randn(3, 3, 6, 7)
    layer(x)  # the padding it was built with, asked once (and kept)
    plain.padding = layer.padding = padding
    with torch.no_grad():
        expected = plain(x)
    state = ClippingState(layer)
    with state.attached():
        state.begin_batch(torch.full((3,), 1e6))  # bounds no record reaches: the clipped sum is the plain sum
        out = layer(x)
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected)
        out.pow(2).sum().backward()
        state.end_draw()
    plain(x).pow(2).sum().backward()
    torch.testing.assert_close(layer.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-5)
