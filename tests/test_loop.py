"""The shared training loop (pdpfast.loop): what it cannot run is refused by name before any step."""
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pdpfast.engine import PrivacyBudgetExceeded
from pdpfast.loop import SequenceCrossEntropy, Task, evaluate, private_engine, private_steps

N = 32


def _data(n=N):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))


def _run(steps=6, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3))
    return private_engine("sample", model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), np.ones(N),
                          delta=1e-5, steps=steps, sample_rate=0.25, batch_size=8, **kwargs)


def _steps(run, **kwargs):
    private_steps(run.engine, run.model, run.optimizer, kwargs.pop("loader", run.loader), Task(), run.criterion,
                  **kwargs)


@pytest.mark.parametrize("kwargs,name", [(dict(kind="regression"), "kind"), (dict(family="bart"), "family"),
                                         (dict(pad_id=-1), "pad_id"), (dict(pad_id=0.5), "pad_id")])
def test_a_task_of_unknown_kind_or_family_is_refused_by_name(kwargs, name):
    """Before: accepted; kind="regression" then trained as classification, family="bart" as plain."""
    with pytest.raises(ValueError, match=f"{name} must be"):
        Task(**kwargs)


def test_a_task_given_as_a_string_is_refused_by_name():
    """Before: AttributeError 'str' object has no attribute 'criterion' / 'evaluate'."""
    with pytest.raises(TypeError, match="task must be a pdpfast.loop.Task"):
        _run(task="lm")
    with pytest.raises(TypeError, match="task must be a pdpfast.loop.Task"):
        evaluate(nn.Linear(5, 3), _data(), task="lm")
    run = _run()
    with pytest.raises(TypeError, match="task must be a pdpfast.loop.Task"):
        private_steps(run.engine, run.model, run.optimizer, run.loader, "lm", run.criterion, until=1)


def test_evaluating_an_empty_dataset_is_refused_rather_than_reported_as_accuracy_0():
    empty = TensorDataset(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="dataset is empty"):
        evaluate(nn.Linear(5, 3), empty)
    with pytest.raises(ValueError, match="batch_size must be an int"):
        Task().evaluate(nn.Linear(5, 3), _data(), batch_size=0)


def test_a_loader_that_yields_no_batch_is_an_error_not_a_hang():
    run = _run()
    with pytest.raises(ValueError, match="loader yielded no batch"):
        _steps(run, loader=[], until=3)


@pytest.mark.parametrize("until,error", [(7.5, ValueError), (0, ValueError), (-3, ValueError), ("9", TypeError),
                                         (True, TypeError)])
def test_until_must_be_a_positive_integer(until, error):
    """Before: 7.5 ran 8 steps, -3 none, "9" a TypeError from comparing int and str."""
    run = _run()
    with pytest.raises(error, match="until must be a positive integer"):
        _steps(run, until=until)
    assert run.engine.steps == 0


def test_until_past_the_plan_is_refused_before_any_step():
    """Before: the plan's steps ran, then PrivacyBudgetExceeded left the batch open."""
    run = _run(steps=6)
    with pytest.raises(ValueError, match=r"until \(7\) is past the plan's 6 steps"):
        _steps(run, until=7)
    assert run.engine.steps == 0
    _steps(run, until=6)
    assert run.engine.steps == 6


def test_a_refused_step_discards_its_draw_so_the_next_run_starts_a_fresh_one():
    """A step the engine refuses (a pre-step hook raising PrivacyBudgetExceeded, as the ledger does) leaves
    no open batch behind: before, the next call failed with "a new Poisson draw began before optimizer.step()"."""
    run = _run(steps=6)

    def refuse_once(optimizer):
        if optimizer.steps == 2 and not refused:
            refused.append(True)
            raise PrivacyBudgetExceeded("refused once")

    refused = []
    run.optimizer.pre_step_hooks.append(refuse_once)
    with pytest.raises(PrivacyBudgetExceeded, match="refused once"):
        _steps(run, until=4)
    assert run.engine.steps == 2
    _steps(run, until=4)
    assert run.engine.steps == 4


@pytest.mark.parametrize("autocast,error", [("bf16", TypeError), (torch.float32, ValueError),
                                            (torch.int8, ValueError)])
def test_autocast_must_be_a_low_precision_dtype(autocast, error):
    """Before: "bf16" failed inside torch.autocast, after the loader had opened a batch."""
    run = _run()
    with pytest.raises(error, match="autocast must be"):
        _steps(run, until=1, autocast=autocast)


def test_on_step_must_be_callable():
    run = _run()
    with pytest.raises(TypeError, match="on_step must be callable"):
        _steps(run, until=1, on_step=5)
    assert run.engine.steps == 0


# ---------------------------------------------------------------------------------------------- empty draws
class _Recording:
    """The Poisson loader, noting each physical batch's rows."""

    def __init__(self, loader):
        self.loader, self.rows = loader, []

    def __iter__(self):
        for batch in self.loader:
            self.rows.append(int(batch[0].shape[0]))
            yield batch


def _rare_draws(model, data, mode="bk"):
    """Mean batch 0.5 of len(data) records: most draws are empty."""
    return private_engine("sample", model, torch.optim.SGD(model.parameters(), lr=0.1), data, np.full(len(data), 4.0),
                          delta=1e-5, steps=12, sample_rate=0.5 / len(data), batch_size=1, mode=mode, seed=3)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_an_empty_draw_skips_the_forward_and_still_takes_the_noised_step(mode):
    """The loop runs no forward on an empty draw; the result is the ordinary loop's (forward, backward
    and step on every draw, the empty ones too), bit for bit: the step is noise only either way."""
    def fresh():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
        return _rare_draws(model, _data(), mode)

    run = fresh()
    recording = _Recording(run.loader)
    _steps(run, until=12, loader=recording)
    assert 0 in recording.rows and any(recording.rows)   # empty draws and full ones both taken
    assert run.engine.steps == 12

    ordinary = fresh()
    while ordinary.engine.steps < 12:
        for batch in ordinary.loader:
            Task().loss(ordinary.model, batch, ordinary.criterion).backward()
            ordinary.optimizer.step()
            ordinary.optimizer.zero_grad()
            if ordinary.engine.steps == 12:
                break
    for skipped, taken in zip(run.model.parameters(), ordinary.model.parameters()):
        assert torch.equal(skipped, taken)
    np.testing.assert_array_equal(run.engine.epsilons(), ordinary.engine.epsilons())


def test_a_hugging_face_bert_trains_through_empty_draws():
    """Before: an empty draw crashed the BERT's attention ("cannot reshape tensor of 0 elements into
    shape [0, 6, -1, 16]"); now each empty draw is a noised step charged to the ledger like any other."""
    from pdpfast.models import build_model

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(1, 50, (20, 6), generator=g), torch.randint(0, 2, (20,), generator=g))
    torch.manual_seed(0)
    model = build_model("bert-micro", input_shape=(6,), num_classes=2, vocab_size=50, input_kind="tokens")
    run = _rare_draws(model, data)
    recording = _Recording(run.loader)
    before = [p.detach().clone() for p in run.model.parameters()]
    private_steps(run.engine, run.model, run.optimizer, recording, Task.for_model("bert-micro"), run.criterion,
                  until=12)
    assert recording.rows.count(0) >= 3 and run.engine.steps == 12
    assert all(not torch.equal(p, b) for p, b in zip(run.model.parameters(), before))   # noise reached every weight
    eps = run.engine.epsilons()
    assert np.all(eps > 0) and np.all(eps <= 4.0)


# ---------------------------------------------------------------------------------------------- language modelling
V, T = 128, 9


def _lm():
    from pdpfast.models import gpt2

    torch.manual_seed(0)
    return gpt2("micro", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).eval()


def _padded_tokens():
    """Ragged records padded on the right with 0; record 1 has a real 0 inside, record 3 is its
    first token and padding only, record 4 has no padding."""
    g = torch.Generator().manual_seed(1)
    lengths = [4, 6, 2, 1, T, 7]
    x = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        x[i, :n] = torch.randint(1, V, (n,), generator=g)
    x[1, 2] = 0
    return x, lengths


@torch.no_grad()
def _oracle_record_losses(model, x, lengths):
    """Record by record: the mean over t < n - 1 of -log p(x[t + 1] | x[:t + 1]); 0 for n ≤ 1."""
    out = []
    for row, n in zip(x, lengths):
        logp = torch.log_softmax(model(input_ids=row[None, :n]).logits[0].double(), -1)
        terms = [-logp[t, row[t + 1]] for t in range(n - 1)]
        out.append(torch.stack(terms).mean() if terms else torch.zeros((), dtype=torch.float64))
    return torch.stack(out)


def test_lm_loss_is_the_mean_over_each_records_real_targets_with_padding_excluded():
    """Before: each record's loss was the mean over all T - 1 targets, pad → pad predictions included."""
    model, (x, lengths), task = _lm(), _padded_tokens(), Task("lm", "gpt2")
    expected = _oracle_record_losses(model, x, lengths)
    per_record = task.loss(model, (x, None), SequenceCrossEntropy("none"))
    torch.testing.assert_close(per_record.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(task.loss(model, (x, None), task.criterion()).double(), expected.sum(), rtol=1e-5,
                               atol=1e-5)


def test_an_lm_record_of_padding_after_its_first_token_has_zero_loss_and_zero_gradient():
    model, (x, _), task = _lm(), _padded_tokens(), Task("lm", "gpt2")
    per_record = task.loss(model, (x, None), SequenceCrossEntropy("none"))
    assert float(per_record[3].detach()) == 0.0
    per_record[3].backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_an_lm_records_loss_depends_only_on_that_record():
    """The privacy property: each record's loss (so its clipped gradient) reads its own row only, even
    with records of other lengths and other padding in the batch."""
    model, (x, _), task = _lm(), _padded_tokens(), Task("lm", "gpt2")
    criterion = SequenceCrossEntropy("none")
    batch = task.loss(model, (x, None), criterion)
    alone = torch.cat([task.loss(model, (row[None], None), criterion) for row in x])
    torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-6)
    other = x.clone()
    other[0] = torch.randint(1, V, (T,), generator=torch.Generator().manual_seed(2))   # record 0: no padding now
    torch.testing.assert_close(task.loss(model, (other, None), criterion)[1:], batch[1:], rtol=1e-5, atol=1e-6)


def test_lm_padding_is_the_tasks_pad_id():
    model, (x, lengths), task = _lm(), _padded_tokens(), Task("lm", "gpt2", pad_id=5)
    x = x.masked_fill(x == 5, 6)
    for i, n in enumerate(lengths):
        x[i, n:] = 5
    torch.testing.assert_close(task.loss(model, (x, None), SequenceCrossEntropy("none")).double(),
                               _oracle_record_losses(model, x, lengths), rtol=1e-5, atol=1e-6)


def test_lm_evaluation_is_the_token_weighted_loss_over_real_targets():
    """Before: perplexity 1.4 on records of 2 real next tokens and 29 pads, against 121 on the real ones.
    loss = total loss over the real targets / their number, perplexity its exp."""
    model, (x, lengths), task = _lm(), _padded_tokens(), Task("lm", "gpt2")
    expected = float((_oracle_record_losses(model, x, lengths) * torch.tensor([max(n - 1, 0) for n in lengths]))
                     .sum()) / sum(max(n - 1, 0) for n in lengths)
    result = evaluate(model, TensorDataset(x, torch.zeros(len(x), dtype=torch.long)), task)
    assert result["loss"] == pytest.approx(expected, rel=1e-5)
    assert result["perplexity"] == pytest.approx(np.exp(expected), rel=1e-5)
    assert Task("lm", "gpt2").evaluate(model, TensorDataset(x, torch.zeros(len(x))), batch_size=2)["loss"] == \
        pytest.approx(expected, rel=1e-5)


def test_lm_evaluation_without_any_real_target_is_refused():
    x = torch.zeros(3, T, dtype=torch.long)
    x[:, 0] = torch.tensor([4, 9, 17])
    with pytest.raises(ValueError, match="no record of the dataset has a next-token target"):
        evaluate(_lm(), TensorDataset(x, torch.zeros(3, dtype=torch.long)), Task("lm", "gpt2"))


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_private_lm_steps_on_padded_records_run_in_both_modes(mode):
    """The summed loss in both modes (ghost wraps the criterion) on ragged padded records."""
    model, (x, _), task = _lm(), _padded_tokens(), Task("lm", "gpt2")
    data = TensorDataset(x.repeat(4, 1), torch.zeros(4 * len(x), dtype=torch.long))
    before = [p.detach().clone() for p in model.parameters()]
    run = private_engine("sample", model, torch.optim.SGD(model.parameters(), lr=0.1), data, np.full(len(data), 8.0),
                         delta=1e-5, steps=2, sample_rate=0.5, batch_size=8, task=task, mode=mode, seed=0)
    losses = []
    private_steps(run.engine, run.model, run.optimizer, run.loader, task, run.criterion, until=2,
                  on_step=lambda step, loss: losses.append(loss))
    assert run.engine.steps == 2 and all(np.isfinite(losses)) and all(0 < v < 2 * np.log(V) for v in losses)
    assert any(not torch.equal(a, p) for a, p in zip(before, run.model.parameters()))
