"""The README's Python examples, run as written, so that a README edit that breaks one fails CI.

The ```python blocks are read from README.md at test time and each is picked by a string it contains,
never by its position, so edits elsewhere in the README do not move them. A self-contained example
runs verbatim in a fresh namespace, in a temporary directory (they write files). A fragment runs in a
namespace holding what the prose around it assumes (a small model, its optimizer, a loader of 64
records, their budgets, the loss), a registration snippet with small stand-ins for the user's
classes. Where a block cannot run here as written it is changed by a textual substitution that must
match once (the DPTrainer example saves and resumes within its few steps, the captured step keeps its
model on the CPU), so a README edit that removes the matched text fails here rather than silently
running something else. Every test then checks what the example claims: budgets kept, numbers shown
in comments, the types returned. A block that cannot run here at all is listed in ``NOT_RUN`` with
the reason, and ``test_every_readme_python_block_is_run_here_or_listed_as_not_run`` makes a new block
be classified. Tracebacks name the README's own lines.
"""
from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pdpfast
from pdpfast.nn import DPModule, LayerRule, rules

README = Path(__file__).resolve().parents[1] / "README.md"
README_TEXT = README.read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```python\n(.*?)^```", README_TEXT, flags=re.MULTILINE | re.DOTALL)

# Each example is found by a string only it contains (the two identical Opacus/pdpfast
# make_private_with_epsilon cells excepted: both are run).
LOOP_WITH_BUDGETS = "for epoch in range(epochs):              # the loop does not change"
PLAN_OF_YOUR_OWN = "sample_rates=plan.sample_rates,"
BROADCAST_REGISTRATION = "register_broadcast_host(MyViT"
LAYER_REGISTRATION = 'register_layer("some_library.layers.MyLayer"'
FUNCTIONAL = "pdpfast.functional.clipped_gradients(model, loss_fn"
OPACUS_SCRIPT = "from opacus import PrivacyEngine\n"
PDPFAST_SCRIPT = "from pdpfast import PrivacyEngine\n"
WITH_EPSILON = "target_epsilon=3.0"
OPACUS_VALIDATOR = "from opacus.validators import ModuleValidator"
PDPFAST_VALIDATOR = "from pdpfast.validators import ModuleValidator"
BUDGETS_COLUMN = "budgets=eps_per_record"
NAMED_RECORDS = "with engine.records(indices):"
BERT = 'bert("tiny", num_labels=2)'
DPTRAINER = "DPTrainer(model=model"
ACCOUNTING = "calibrate(budgets, delta=1e-5, steps=9375"
ADAPTIVE = "QuantileClipping(target_quantile="
FEDERATED = "fl.simulate("
CAPTURED_STEP = "engine.make_step("
RUN = (LOOP_WITH_BUDGETS, PLAN_OF_YOUR_OWN, BROADCAST_REGISTRATION, LAYER_REGISTRATION, FUNCTIONAL, OPACUS_SCRIPT,
       PDPFAST_SCRIPT, WITH_EPSILON, OPACUS_VALIDATOR, PDPFAST_VALIDATOR, BUDGETS_COLUMN, NAMED_RECORDS, BERT,
       DPTRAINER, ACCOUNTING, ADAPTIVE, FEDERATED, CAPTURED_STEP)

NOT_RUN = {
    'init_process_group("nccl"': "DistributedDataParallel: needs NCCL GPUs and a launcher (torchrun) giving "
                                 "local_rank, and its make_private_with_budgets call has `...` for arguments; "
                                 "tests/test_distributed.py runs the same path with two gloo processes",
}

N, FEATURES, CLASSES, BATCH = 64, 6, 3, 16
DELTA = 1e-5


def blocks(marker: str) -> list[str]:
    """Every README python block that contains ``marker`` (at least one)."""
    found = [b for b in BLOCKS if marker in b]
    assert found, f"no ```python block of README.md contains {marker!r} any more"
    return found


def block(marker: str) -> str:
    """The one README python block that contains ``marker``."""
    found = blocks(marker)
    assert len(found) == 1, f"{len(found)} README python blocks contain {marker!r}; pick a more distinctive string"
    return found[0]


def substituted(code: str, substitutions: dict[str, str]) -> str:
    """``code`` with each key of ``substitutions`` replaced by its value, each key found exactly once."""
    for old, new in substitutions.items():
        assert code.count(old) == 1, f"the README example no longer contains {old!r} once; update the substitution"
        code = code.replace(old, new)
    return code


def run(code: str, namespace: dict | None = None, *, source: str | None = None) -> dict:
    """Execute ``code`` in a copy of ``namespace`` (fresh by default) and return the namespace.

    ``source`` is the README block ``code`` was made from (default: ``code`` itself), line for line,
    so that a traceback names the README's own lines.
    """
    namespace = dict(namespace or {})
    first_line = README_TEXT[:README_TEXT.index(source or code)].count("\n")
    exec(compile("\n" * first_line + code, str(README), "exec"), namespace)
    return namespace


def fragment_namespace(**extra) -> dict:
    """What the README's fragments take from the reader's script: a small classifier, its optimizer,
    a loader of N records (batches of BATCH), one budget per record, the loss, the epochs and an engine."""
    x, y = torch.randn(N, FEATURES), torch.randint(0, CLASSES, (N,))
    dataset = TensorDataset(x, y)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))
    loader = DataLoader(dataset, batch_size=BATCH)
    budgets = np.random.default_rng(0).choice([1.0, 3.0, 8.0], size=N)
    namespace = dict(torch=torch, np=np, pdpfast=pdpfast, model=model, dataset=dataset, x=x, y=y,
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_loader=loader, loader=loader,
                     budgets=budgets, eps_per_record=budgets, criterion=nn.CrossEntropyLoss(), epochs=2,
                     batch_size=BATCH, steps_per_epoch=N // BATCH, engine=pdpfast.PrivacyEngine(seed=0))
    namespace.update(extra)
    return namespace


def train(namespace: dict, epochs: int, loader: str = "loader") -> None:
    """The ordinary loop over ``namespace[loader]`` for ``epochs`` epochs."""
    model, optimizer, criterion = namespace["model"], namespace["optimizer"], namespace["criterion"]
    for _ in range(epochs):
        for x, y in namespace[loader]:
            criterion(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()


def per_sample_loss(outputs, labels):
    return nn.functional.cross_entropy(outputs, labels, reduction="none")


@pytest.fixture
def restored_layer_registry():
    """Undo the registrations a README snippet makes, so the other tests see pdpfast's own registry.

    pdpfast.nn has no call to unregister, so the tables of ``pdpfast.nn.rules`` are copied and put
    back; the generation counter moves on (never back), so ``convert``'s cached lookups are redone.
    """
    tables = (rules._RULES, rules._DP_CLASSES, rules._DP_CLASSES_BY_NAME)
    saved = [dict(table) for table in tables]

    def restore():
        for table, before in zip(tables, saved):
            table.clear()
            table.update(before)
        rules._generation = rules.generation() + 1

    yield restore
    restore()


def test_every_readme_python_block_is_run_here_or_listed_as_not_run():
    unclassified = [b for b in BLOCKS if not any(marker in b for marker in (*RUN, *NOT_RUN))]
    assert not unclassified, ("README python blocks neither run by this file nor listed in NOT_RUN:\n\n"
                              + "\n---\n".join(unclassified))
    for marker in NOT_RUN:
        block(marker)


def test_the_readme_loop_with_budgets_keeps_every_record_within_its_budget(capsys):
    namespace = run(block(LOOP_WITH_BUDGETS), fragment_namespace())
    engine, budgets = namespace["engine"], namespace["budgets"]
    assert capsys.readouterr().out == "True\n"
    assert isinstance(namespace["optimizer"], pdpfast.DPOptimizer)
    assert isinstance(namespace["train_loader"], pdpfast.DPDataLoader)
    assert engine.steps == engine.plan.steps == namespace["epochs"] * len(namespace["train_loader"])
    assert np.all(engine.epsilons() <= budgets) and np.all(engine.epsilons() >= 0.99 * budgets)
    # "raises PrivacyBudgetExceeded before any record would overspend": one step past the plan
    x, y = next(iter(namespace["train_loader"]))
    namespace["criterion"](namespace["model"](x), y).backward()
    with pytest.raises(pdpfast.PrivacyBudgetExceeded):
        namespace["optimizer"].step()
    assert np.all(engine.epsilons() <= budgets)


def test_the_readme_plan_of_your_own_runs_plan_steps_without_a_ledger():
    namespace = run(block(PLAN_OF_YOUR_OWN), fragment_namespace())
    engine, plan = namespace["engine"], namespace["plan"]
    assert isinstance(plan, pdpfast.PrivacyPlan) and engine.plan is None  # "keeps no ledger"
    np.testing.assert_array_equal(engine.sample_rates, plan.sample_rates)
    train(namespace, namespace["epochs"], loader="train_loader")
    assert engine.steps == plan.steps
    assert np.all(plan.epsilons() <= namespace["budgets"])


def test_the_readme_plan_of_your_own_is_within_budget_by_the_plan_and_a_hair_above_on_the_engines_grid():
    """What the README says of that route: after plan.steps, plan.epsilons() (each budget certified at
    its own RDP order) is within the budgets; engine.get_epsilon (a fixed grid of orders) may read a
    little above the largest, never by more than ~1e-4 relative."""
    namespace = run(block(PLAN_OF_YOUR_OWN), fragment_namespace())
    train(namespace, namespace["epochs"], loader="train_loader")
    engine, plan, budgets = namespace["engine"], namespace["plan"], namespace["budgets"]
    assert engine.steps == plan.steps
    assert np.all(plan.epsilons() <= budgets)
    assert engine.get_epsilon(DELTA) <= budgets.max() * (1 + 1e-4)


class MyLayerScale(nn.Module):
    """Stands for the reader's layer scale: forward is x * gamma."""

    def __init__(self, d: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.gamma


class MyViT(nn.Module):
    """Stands for the reader's vision transformer: class token and position embedding used batch-aligned."""

    def __init__(self, d: int = 8, patches: int = 4, classes: int = 3):
        super().__init__()
        self.patch = nn.Conv2d(3, d, kernel_size=4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, patches + 1, d))
        self.fc = nn.Linear(d, d)
        self.scale = MyLayerScale(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = x + self.scale(self.fc(x).tanh())
        return self.head(x[:, 0])


def test_the_readme_broadcast_registration_makes_ones_own_vit_convert_and_clip_exactly(
        restored_layer_registry, oracle):
    run(block(BROADCAST_REGISTRATION), dict(pdpfast=pdpfast, MyViT=MyViT, MyLayerScale=MyLayerScale))
    reference = MyViT().double()
    model = pdpfast.nn.convert(copy.deepcopy(reference))
    assert isinstance(model, pdpfast.nn.DPBroadcastHost) and isinstance(model.scale, pdpfast.nn.DPLayerScale)
    result, _ = oracle.check(model, per_sample_loss, (torch.randn(5, 3, 8, 8, dtype=torch.float64),),
                             (torch.randint(0, 3, (5,)),), reference=reference)
    assert {"cls_token", "pos_embed", "scale.gamma"} <= set(result.grads)


class MyLayer(nn.Module):
    """Stands for the reader's layer family: an elementwise scale y = x ⊙ s, s (d,)."""

    def __init__(self, d: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.scale


class DPMyLayer(DPModule, MyLayer):
    def _compute(self, x, p):
        return x * p["scale"]


def per_sample_grads(module, x, o):
    """{"scale": (B, d)}: the sample's Σ over positions of x ⊙ ∂L/∂y."""
    return {"scale": (x * o).reshape(x.shape[0], -1, x.shape[-1]).sum(1)}


def test_the_readme_layer_registration_forms_each_make_a_layer_family_convert_and_clip_exactly(
        restored_layer_registry, oracle):
    # The snippet shows two alternatives (by class, by qualified name), each run here on its own
    # registry: run one after the other, the second is refused, since DPMyLayer already has a rule
    # and `rule` is another LayerRule object.
    snippet = block(LAYER_REGISTRATION)
    lines = snippet.splitlines()
    calls = [line for line in lines if line.startswith("register_layer(")]
    assert len(calls) == 2
    in_library = type("MyLayer", (MyLayer,), {"__module__": "some_library.layers"})
    for call, layer_class in zip(calls, (MyLayer, in_library)):
        restored_layer_registry()
        alone = "\n".join("" if line in calls and line != call else line for line in lines)  # the other call blanked
        run(alone, dict(MyLayer=MyLayer, DPMyLayer=DPMyLayer, per_sample_grads=per_sample_grads,
                        rule=LayerRule(per_sample_grads)), source=snippet)
        reference = nn.Sequential(nn.Linear(4, 6), layer_class(6), nn.Tanh(), nn.Linear(6, 3)).double()
        model = pdpfast.nn.convert(copy.deepcopy(reference))
        assert isinstance(model[1], DPMyLayer), call
        result, _ = oracle.check(model, per_sample_loss, (torch.randn(5, 4, dtype=torch.float64),),
                                 (torch.randint(0, 3, (5,)),), reference=reference)
        assert "1.scale" in result.grads


def test_the_readme_functional_entry_point_matches_the_per_sample_oracle(oracle):
    reference = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES)).double()
    x, y = torch.randn(7, FEATURES, dtype=torch.float64), torch.randint(0, CLASSES, (7,))
    per_sample = oracle.per_sample_grads(reference, per_sample_loss, (x,), (y,))
    bounds = oracle.bounds(oracle.expected(reference, per_sample, torch.ones(7)).norms)  # some clipped, some not
    namespace = run(block(FUNCTIONAL), dict(pdpfast=pdpfast, model=copy.deepcopy(reference), inputs=(x,), c=bounds,
                                            loss_fn=lambda outputs: per_sample_loss(outputs, y)))
    oracle.assert_matches(namespace["result"], oracle.expected(reference, per_sample, bounds))


def test_the_readme_opacus_script_runs_under_pdpfast_with_one_changed_import_and_the_same_epsilon():
    opacus_script, pdpfast_script = block(OPACUS_SCRIPT), block(PDPFAST_SCRIPT)
    assert pdpfast_script == opacus_script.replace("from opacus import", "from pdpfast import")
    ours = run(pdpfast_script, fragment_namespace())
    assert isinstance(ours["optimizer"], pdpfast.DPOptimizer) and ours["engine"].steps == len(ours["loader"])
    pytest.importorskip("opacus")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        theirs = run(opacus_script, fragment_namespace())
    assert ours["eps"] == pytest.approx(theirs["eps"], rel=1e-9)  # "ε equals Opacus's ... to 1e-9 relative"


def test_the_readme_make_private_with_epsilon_ends_at_the_target_with_less_noise_than_opacus():
    first, second = blocks(WITH_EPSILON)  # the Opacus cell and the pdpfast cell: the same code
    assert first == second
    ours = run(second, fragment_namespace(engine=pdpfast.PrivacyEngine(accountant="rdp", seed=0)))
    train(ours, 10)
    assert ours["engine"].steps == 10 * len(ours["loader"])
    assert 3.0 * (1 - 1e-6) <= ours["engine"].get_epsilon(DELTA) <= 3.0  # "ε ends at the target, never above"
    opacus = pytest.importorskip("opacus")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        theirs = run(first, fragment_namespace(engine=opacus.PrivacyEngine(accountant="rdp")))
    assert ours["optimizer"].noise_multiplier <= theirs["optimizer"].noise_multiplier  # "a little smaller"


def cnn_with_batchnorm() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 24, 3), nn.BatchNorm2d(24), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))


def test_the_readme_module_validator_fix_swaps_batchnorm_for_groupnorm_under_pdpfast_and_opacus():
    original = cnn_with_batchnorm()
    ours = run(block(PDPFAST_VALIDATOR), dict(model=original))["model"]
    assert ours is not original  # "fix returns a copy"
    norms = [m for m in ours.modules() if isinstance(m, nn.GroupNorm)]
    assert [(m.num_groups, m.num_channels) for m in norms] == [(8, 24)]  # GroupNorm(gcd(32, C), C)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in ours.modules())
    pytest.importorskip("opacus")
    theirs = run(block(OPACUS_VALIDATOR), dict(model=cnn_with_batchnorm()))["model"]
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in theirs.modules())


def test_the_readme_budgets_argument_keeps_every_record_within_its_budget():
    namespace = run(block(BUDGETS_COLUMN), fragment_namespace())
    engine = namespace["engine"]
    train(namespace, 10)
    assert engine.steps == engine.plan.steps == 10 * len(namespace["loader"])
    assert np.all(engine.epsilons() <= namespace["eps_per_record"])


def test_the_readme_named_batch_takes_a_private_step_and_an_unnamed_one_is_refused():
    namespace = fragment_namespace()
    engine = namespace["engine"]
    namespace["model"], namespace["optimizer"], namespace["loader"] = engine.make_private_with_budgets(
        module=namespace["model"], optimizer=namespace["optimizer"], data_loader=namespace["loader"],
        budgets=namespace["budgets"], delta=DELTA, epochs=2)
    indices = torch.tensor([3, 7, 11, 12])
    batch = dict(indices=indices, x=namespace["x"][indices], y=namespace["y"][indices])
    with pytest.raises(RuntimeError, match="open batch"):  # "Without that, its forward is refused"
        namespace["model"](batch["x"])
    before = [p.detach().clone() for p in namespace["model"].parameters()]
    with pytest.warns(UserWarning, match="Poisson"):  # "a one-time warning says the accounting assumes Poisson"
        run(block(NAMED_RECORDS), {**namespace, **batch})
    assert engine.steps == 1
    assert any(not torch.equal(b, p) for b, p in zip(before, namespace["model"].parameters()))


def test_the_readme_bert_example_runs_and_keeps_every_record_within_its_budget(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    namespace = run(block(BERT))  # ends with the example's own `assert np.all(spent <= budgets)`
    engine = namespace["engine"]
    assert engine.steps == engine.plan.steps
    assert (tmp_path / "bert_tiny_private.pt").stat().st_size > 0
    # the prose below the block: "It prints, per budget group, the largest ε spent: 1.000, 3.000 and 8.000"
    claimed = re.search(r"the largest ε spent: ([\d.]+), ([\d.]+) and ([\d.]+)", README.read_text(encoding="utf-8"))
    printed = re.findall(r"largest ε spent ([\d.]+)", capsys.readouterr().out)
    assert claimed is not None and printed == list(claimed.groups())


def test_the_readme_dptrainer_example_trains_resumes_and_keeps_every_record_within_its_budget(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)
    n, seq, vocab = 128, 8, 40  # 2 steps of 16 × 4 expected records an epoch: 6 steps in all
    ids = torch.randint(3, vocab, (n, seq))
    train_records = [{"input_ids": ids[i], "attention_mask": torch.ones(seq, dtype=torch.long),
                      "labels": ids[i, 0] % 2} for i in range(n)]
    config = transformers.BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=2)
    budgets = np.r_[np.full(n // 2, 2.0), np.full(n - n // 2, 8.0)]
    # save and log within the 6 steps; the run "after an interruption" resumes from step 4
    code = substituted(block(DPTRAINER), {"logging_steps=10": "logging_steps=2", "save_steps=100": "save_steps=2",
                                          "checkpoint-100": "checkpoint-4"})
    first, resumed = code.split("# after an interruption", 1)
    context = dict(model=transformers.BertForSequenceClassification(config), train=train_records, budgets=budgets)
    namespace = run(first, context, source=block(DPTRAINER))
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 6 and (tmp_path / "out" / "checkpoint-2").is_dir()
    spent = trainer.epsilons()
    assert np.all(spent <= budgets) and np.all(spent >= 0.99 * budgets)
    logged = set().union(*trainer.state.log_history)
    assert {"epsilon", "epsilon_budget_2", "epsilon_budget_8"} <= logged  # "logs epsilon, epsilon_budget_<ε>"
    # "a checkpoint older than the steps a trainer has taken is refused: a roll-back"
    with pytest.raises(ValueError, match="roll the privacy ledger back"):
        trainer.train(resume_from_checkpoint="out/checkpoint-2")
    # "in a new process: the same DPTrainer(...)": the block's construction, then its resume line
    construction = first[first.index("args = TrainingArguments"):first.index("trainer.train()")]
    again = run(construction + "# after an interruption" + resumed,
                dict(context, model=transformers.BertForSequenceClassification(config),
                     TrainingArguments=transformers.TrainingArguments, DPTrainer=namespace["DPTrainer"]),
                source=block(DPTRAINER))
    assert again["trainer"].state.global_step == 6
    np.testing.assert_allclose(again["trainer"].epsilons(), spent, rtol=1e-9)


def test_the_readme_accounting_example_runs_and_its_noise_multiplier_is_the_one_shown(tmp_path, monkeypatch,
                                                                                      capsys):
    monkeypatch.chdir(tmp_path)
    code = block(ACCOUNTING)
    namespace = run(code)  # ends with the example's own `assert (plan.epsilons() <= budgets).all()`
    plan, budgets = namespace["plan"], namespace["budgets"]
    assert len(plan.groups) == len(np.unique(budgets)) and capsys.readouterr().out.startswith("PrivacyPlan(")
    reread = namespace["PrivacyPlan"].from_json((tmp_path / "plan.json").read_text())
    np.testing.assert_array_equal(reread.sample_rates, plan.sample_rates)
    ledger = namespace["IndividualAccountant"].load("ledger.npz")
    assert ledger.steps_taken == 1 and ledger.would_exceed(DELTA).shape == budgets.shape
    # every "expression  # ≈ value" line: the value to the precision it is printed with
    shown = re.findall(r"^(.+?)\s*#\s*≈\s*(-?\d+\.(\d+))\s*$", code, flags=re.MULTILINE)
    assert shown, "the accounting example no longer shows a value with '# ≈'"
    for expression, value, decimals in shown:
        assert round(eval(expression, namespace), len(decimals)) == float(value), expression


def test_the_readme_accounting_ledger_lets_every_record_take_all_the_plans_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = run(block(ACCOUNTING))
    ledger, plan = namespace["ledger"], namespace["plan"]
    ledger.step(plan.steps - 2)  # the example took one step already
    assert not ledger.would_exceed(DELTA).any()


def test_the_readme_adaptive_example_records_its_history_and_keeps_every_record_within_its_budget():
    namespace = run(block(ADAPTIVE), fragment_namespace())
    engine = namespace["engine"]
    train(namespace, 10)
    assert engine.steps == engine.plan.steps == 10 * len(namespace["loader"])
    assert len(engine.adaptive.history) == engine.steps
    assert {"clip_norms", "noise_std", "count_std"} <= set(engine.adaptive.history[-1])
    assert np.all(engine.epsilons() <= namespace["budgets"])


def test_the_readme_federated_example_runs_and_keeps_every_record_within_its_budget(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = run(block(FEDERATED))
    res = namespace["res"]
    assert res.accuracy.shape == (res.config["rounds"] + 1,)  # "(T+1,)"
    assert res.epsilon_clients.shape == res.epsilon_server.shape == res.budgets.shape
    np.testing.assert_array_equal(res.epsilon, res.epsilon_clients)   # "threat="clients" here"
    assert np.all(res.epsilon <= res.budgets) and res.within_budget()


def test_the_readme_captured_step_example_runs_eagerly_on_the_cpu():
    # the one substitution: the model stays on the CPU, where make_step runs the same step without a
    # graph (the capture itself is tests/test_cuda.py's and tests/kernels/test_captured_step.py's)
    code = substituted(block(CAPTURED_STEP), {"module=model.cuda()": "module=model"})
    namespace = run(code, fragment_namespace(), source=block(CAPTURED_STEP))
    engine = namespace["engine"]
    assert engine.steps == len(namespace["train_loader"]) and np.isfinite(float(namespace["loss"]))
    assert np.all(engine.epsilons() <= namespace["budgets"])
