"""The captured step's protocol (``pdpfast.graphs.PrivateStep``), checked on the CPU with the kernels.

Nothing is captured without a GPU. Here a stand-in for ``_Body.replay`` runs a body where a
capture would record it, every time (each call is a "first capture", so the host side runs as it
does in a real capture), while the Triton kernels run under the interpreter. What a real capture
depends on can then be checked on any machine (five models, fp32 and bf16, both call routes; draws
of one physical batch and of two, so all three bodies, whole step, accumulate and update, are
captured and replayed):

* every kernel variant (kernel, constexpr arguments) a capture launches was launched eagerly
  before it: a CUDA capture cannot compile and load a module (``cuModuleLoadData`` is refused while
  a stream captures), so a variant first seen inside the capture fails there;
* the warm-up rehearses the capture: a body's first capture issues exactly the stream of aten ops
  and launches of its last eager run (with ``torch.cuda.is_current_stream_capturing()`` True during
  the stand-in capture, for code such as Hugging Face's mask helpers that branches on it);
* a replay would repeat what its capture recorded: every later run of a body issues the same
  aten ops and Triton launches with the same non-tensor arguments (a value read on the host that
  changes from step to step, such as a host-side seed, would be baked into the graph) and the
  same tensor shapes;
* the device-side (seed, step) counter the captured noise reads follows the optimizer: the noise
  equals the ordinary loop's, through warm-up, capture and a checkpoint that brings another seed,
  and whichever bodies the draws take (draws of one batch go through accumulate and update when
  the warm-up never rehearsed the whole step).

The capture and replay themselves are checked on CUDA in ``tests/test_cuda.py``.
"""
import inspect
import math
import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

import pdpfast
from pdpfast import graphs

# on a GPU the kernels take CUDA tensors, not these CPU ones, and tests/test_cuda.py captures for real
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                reason="the stand-in capture runs the kernels under TRITON_INTERPRET=1")

N = 48


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3)), torch.randn(N, 6)


def _transformer():
    from bench.models import TinyTransformer

    return TinyTransformer(vocab=20, d=16, layers=1, heads=2, seq=7, classes=3), torch.randint(0, 20, (N, 7))


def _cnn():
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, stride=2, groups=2), nn.Flatten(), nn.Linear(36, 3))
    return model, torch.randn(N, 2, 8, 8)


class _Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        logits = self.model(x).logits
        return logits if logits.dim() == 2 else logits[:, -1]  # a language model: the last token's


def _bert():
    pytest.importorskip("transformers")
    from pdpfast.models import bert

    model = bert("micro", num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _Logits(model), torch.randint(1, 100, (N, 7))


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=23, n_positions=8, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)  # its head is tied to the token embedding
    model.config._attn_implementation = "eager"
    return _Logits(model), torch.randint(0, 23, (N, 6))


MODELS = {"mlp": _mlp, "transformer": _transformer, "groupnorm-cnn": _cnn, "bert": _bert, "gpt2-tied": _gpt2}


def _engine(seed=6, clipping="flat", model="mlp", dtype=torch.float32, physical_batch_size=12):
    """Draws of one physical batch and of two: with seed 6 and 12 rows, four of one, one of two,
    one of one, one of two, one of one."""
    torch.manual_seed(0)
    model, x = MODELS[model]()
    model, x = model.to(dtype), x.to(dtype) if x.is_floating_point() else x
    data = TensorDataset(x, torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(1)))
    engine = pdpfast.PrivacyEngine(seed=seed)
    model, opt, loader = engine.make_private_with_budgets(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9),
        data_loader=DataLoader(data, batch_size=12), budgets=np.repeat([1.0, 4.0], N // 2), delta=1e-5, steps=8,
        method="hybrid", physical_batch_size=physical_batch_size, clipping=clipping)
    return engine, model, opt, loader


def _loss(model):
    return lambda x, y: nn.functional.cross_entropy(model(x), y)


def _run(opt, loader, draws, call):
    while True:
        for batch in loader:
            call(*batch)
            if opt.steps == draws and loader.current.is_last:
                return


def _ordinary(model, opt, loader, draws):
    def call(x, y):
        _loss(model)(x, y).backward()
        opt.step()
        opt.zero_grad()
    _run(opt, loader, draws, call)


def _describe(tree):
    """What a replay would bake in of an op's arguments: every value but the tensors' contents."""
    def one(x):
        if isinstance(x, torch.Tensor):
            return "tensor", tuple(x.shape), x.dtype
        if isinstance(x, (torch.UntypedStorage, torch.TypedStorage)):
            return "storage", x.nbytes()
        if isinstance(x, float) and math.isnan(x):
            return "nan"
        return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)) else type(x).__name__
    return tuple(one(x) for x in pytree.tree_leaves(tree))


class _Record(TorchDispatchMode):
    """The stand-in capture's record: Triton launches by variant (kernel, constexpr and launch-option
    arguments) and, for each run of a body, its stream of aten ops and Triton launches with every
    argument a replay would bake in."""

    def __init__(self):
        super().__init__()
        self.seen, self.first_in_capture, self.capturing = set(), [], False
        self.first_capture, self.last_eager, self.captured_kinds = {}, {}, set()
        self.compared, self.stale, self.unrehearsed = 0, [], []
        self.stream: list | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "profiler":  # record_function markers launch nothing
            self.stream.append((str(func), _describe((args, kwargs))))
        return func(*args, **(kwargs or {}))

    def launch(self, fn, grid, args, kwargs) -> None:
        params = inspect.signature(fn.fn).parameters
        bound = dict(zip(params, args), **kwargs)
        variant = (fn.__name__, tuple(sorted(
            (k, v) for k, v in bound.items()
            if k not in params or "constexpr" in str(params[k].annotation))))
        if self.capturing and variant not in self.seen:
            self.first_in_capture.append(variant)
        if self.stream is not None:
            self.stream.append((fn.__name__, _describe((grid, args, kwargs))))
        self.seen.add(variant)

    def _run(self, body, run) -> tuple[object, list]:
        self.stream = stream = []
        try:
            with self:
                outputs = run()
        finally:
            self.stream = None
        return outputs, stream

    def eager(self, body, run) -> object:
        outputs, self.last_eager[body.key] = self._run(body, run)
        return outputs

    def capture(self, body) -> tuple:
        """Runs ``body`` as a capture would record it (``torch.cuda.is_current_stream_capturing()``
        is True meanwhile, for code that branches on it). Its first capture must issue the stream
        of the last eager run of the same body before it (the warm-up rehearses the capture), and
        later runs that of the first capture (a replay repeats it)."""
        self.capturing = True
        capturing = torch.cuda.is_current_stream_capturing
        torch.cuda.is_current_stream_capturing = lambda: True
        def run():  # as _Body.replay captures it: inside the body's guard
            with body.guard():
                return body.fn()
        try:
            outputs, stream = self._run(body, run)
        finally:
            self.capturing = False
            torch.cuda.is_current_stream_capturing = capturing
        key = body.key
        first = self.first_capture.setdefault(body, stream)
        self.captured_kinds.add(key if isinstance(key, str) else key[1])
        if first is stream:
            self._compare(self.last_eager.get(key, []), stream, self.unrehearsed)
        else:
            self.compared += 1
            self._compare(first, stream, self.stale)
        return outputs, True

    @staticmethod
    def _compare(expected: list, got: list, mismatches: list) -> None:
        if expected != got:
            at = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
            mismatches.append((at, expected[at:at + 1], got[at:at + 1], len(expected), len(got)))


@pytest.fixture
def captured(monkeypatch):
    """Makes ``make_step(..., cuda_graph=False)`` steps behave as captured ones (see the module
    docstring); yields the record."""
    from triton.runtime.interpreter import InterpretedFunction

    record = _Record()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        record.launch(self, grid, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    eager = graphs._Body.run_eagerly
    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    monkeypatch.setattr(graphs._Body, "replay", lambda body: record.capture(body))
    monkeypatch.setattr(graphs._Body, "run_eagerly",
                        lambda body, side_stream: record.eager(body, lambda: eager(body, False)))
    return record


def _captured_step(engine, model):
    step = engine.make_step(_loss(model), cuda_graph=False)
    step.cuda_graph = True  # the CUDA path of PrivateStep, with the stand-in capture
    return step


@pytest.fixture(params=["model", "large"])
def route(request, monkeypatch):
    """"large": every layer call takes a full-size model's route on a GPU (on its own, no
    per-sample gradient formed), as ``bench.bench_overhead --route large`` sets it."""
    if request.param == "large":
        from pdpfast import clipping
        from pdpfast.ops import linear

        for module, name in ((clipping, "SMALL_CALL_BYTES"), (linear, "MATERIALIZE_RATIO"),
                             (linear, "MATERIALIZE_MIN_ELEMENTS")):
            monkeypatch.setattr(module, name, 0)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("model", list(MODELS))
def test_captured_step_loads_every_kernel_before_capture_and_bakes_in_no_changing_host_value(
        captured, route, model, clipping, dtype):
    engine, model, opt, loader = _engine(clipping=clipping, model=model, dtype=dtype)
    step = _captured_step(engine, model)
    _run(opt, loader, 8, step)  # draws of one physical batch of 12 rows and of two
    assert step.eager_steps == step.warmup == 2
    assert captured.captured_kinds == {"accumulate", "update", "whole step"}  # every body was "captured"
    assert any(name == "_add_noise_kernel" and ("SEED_FROM_PTR", True) in args for name, args in captured.seen)
    if dtype == torch.bfloat16:  # the backward's norm kernels ran (in fp32 some norms are torch's)
        assert {name for name, _ in captured.seen} - {"_add_noise_kernel"}
    assert captured.first_in_capture == []
    assert captured.compared > 0 and captured.stale == []
    assert captured.unrehearsed == []


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("seed,physical_batch_size", [(6, 12), (10, 13)],
                         ids=["several-first-met-after-warm-up", "whole-step-first-met-after-warm-up"])
def test_captured_step_noise_follows_the_seed_and_step_through_warm_up_and_capture(
        captured, clipping, seed, physical_batch_size):
    """Seed 6: four draws of one batch, then draws of two; seed 10: three draws of two, then of one.
    A body first met after the warm-up is rehearsed then captured, and the noise never moves."""
    a_engine, a_model, a_opt, a_loader = _engine(seed, clipping, physical_batch_size=physical_batch_size)
    _ordinary(a_model, a_opt, a_loader, 8)
    b_engine, b_model, b_opt, b_loader = _engine(seed, clipping, physical_batch_size=physical_batch_size)
    step = _captured_step(b_engine, b_model)
    _run(b_opt, b_loader, 8, step)
    assert captured.captured_kinds == {"accumulate", "update", "whole step"}
    assert captured.first_in_capture == [] and captured.unrehearsed == [] and captured.stale == []
    for p, q in zip(b_model.parameters(), a_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    np.testing.assert_array_equal(b_engine.epsilons(), a_engine.epsilons())


def test_captured_step_follows_a_later_checkpoint_of_its_run(captured, tmp_path):
    """A checkpoint of the same run, ahead of a running captured step, brings its step count and the
    optimizer's state: the counter on the device takes the step (the noise of step t comes from (seed, t))
    and training goes on as the uninterrupted run. Another run's checkpoint (other seeds) is refused by an
    engine that took steps: its released steps would drop out of the ledger."""
    a_engine, a_model, a_opt, a_loader = _engine(seed=3)
    _ordinary(a_model, a_opt, a_loader, 6)
    b_engine, b_model, b_opt, b_loader = _engine(seed=3)
    _ordinary(b_model, b_opt, b_loader, 5)
    b_engine.save_checkpoint(tmp_path / "ckpt.pt", b_model)

    c_engine, c_model, c_opt, c_loader = _engine(seed=3)
    step = _captured_step(c_engine, c_model)
    _run(c_opt, c_loader, 3, step)  # warm-up and capture at steps 0-2
    c_engine.load_checkpoint(tmp_path / "ckpt.pt", c_model)
    assert c_engine.steps == 5
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*captured again")   # the optimizer's state changed
        _run(c_opt, c_loader, 6, step)
    for p, q in zip(c_model.parameters(), a_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_captured_step_keeps_one_norm_launch_per_call_in_warm_up_and_capture(captured, route, clipping):
    """Eagerly, same-shape calls (the transformer's attention projections) share a norm launch
    (``linear_sq_norms_grouped``): its table of offsets is copied from the host, which a capture
    cannot replay, and a replay issues nothing from the host anyway. The captured step's bodies keep
    one launch per call, in the warm-up too, so that the capture meets only kernels the warm-up
    compiled; an ordinary step of the same engine afterwards groups again."""
    if route != "large":
        pytest.skip("at the model's own sizes the small calls stack instead (one launch, copied)")
    engine, model, opt, loader = _engine(clipping=clipping, model="transformer")
    step = _captured_step(engine, model)
    _run(opt, loader, 4, step)
    assert captured.captured_kinds and captured.first_in_capture == [] and captured.unrehearsed == []
    names = {name for name, _ in captured.seen}
    assert "_linear_gram_sq_norms_kernel" in names and "_linear_gram_sq_norms_grouped_kernel" not in names
    assert engine.state.group_calls
    captured.seen.clear()
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()  # an ordinary step: the calls share launches
    assert "_linear_gram_sq_norms_grouped_kernel" in {name for name, _ in captured.seen}
