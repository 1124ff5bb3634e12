"""``DPTrainer``: Hugging Face Trainer with per-record budgets (tiny BERT and GPT-2 on the CPU)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from pdpfast.integrations.transformers import DPTrainer, default_per_sample_loss  # noqa: E402

N, T, VOCAB = 48, 8, 40


class Records(Dataset):
    """Token records whose label is set by their first token (learnable in a few steps)."""

    def __init__(self, n=N, lm=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (n, T), generator=g)
        self.labels = self.ids.clone() if lm else (self.ids[:, 0] % 2)
        self.lm = lm

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(T, dtype=torch.long), "labels": self.labels[i]}


def bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def arguments(tmp_path, **overrides):
    options = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                   learning_rate=5e-3, max_steps=6, logging_steps=2, save_strategy="no", report_to=[],
                   use_cpu=True, seed=3, disable_tqdm=True)
    options.update(overrides)
    return transformers.TrainingArguments(**options)


BUDGETS = np.r_[np.full(N // 2, 2.0), np.full(N - N // 2, 8.0)]


@pytest.mark.parametrize("make_model,lm", [(bert, False), (gpt2, True)], ids=["bert", "gpt2"])
def test_every_record_stays_within_its_budget_and_epsilon_is_logged(tmp_path, make_model, lm):
    trainer = DPTrainer(model=make_model(), args=arguments(tmp_path), train_dataset=Records(lm=lm),
                        budgets=BUDGETS, delta=1e-5, method="hybrid")
    trainer.train()
    eps = trainer.epsilons()
    assert trainer.privacy_engine.steps == 6
    assert np.all(eps <= BUDGETS) and np.all(eps > 0)
    np.testing.assert_array_equal(eps, trainer.privacy_engine.epsilons())
    logged = [h for h in trainer.state.log_history if "epsilon" in h]
    assert logged and {"epsilon_budget_2", "epsilon_budget_8"} <= set(logged[-1])
    assert logged[-1]["epsilon_budget_2"] <= 2.0 and logged[-1]["epsilon_budget_8"] <= 8.0
    assert not any("grad_norm" in h for h in trainer.state.log_history)  # pre-noise norm: never logged


@pytest.mark.parametrize("mode,clipping", [("ghost", "flat"), ("bk", "per_layer")])
def test_other_clipping_modes(tmp_path, mode, clipping):
    trainer = DPTrainer(model=bert(), args=arguments(tmp_path, max_steps=2), train_dataset=Records(),
                        budgets=BUDGETS, delta=1e-5, mode=mode, clipping=clipping)
    trainer.train()
    assert trainer.privacy_engine.steps == 2 and np.all(trainer.epsilons() <= BUDGETS)


def test_gradient_accumulation_is_physical_batches_of_one_step(tmp_path):
    trainer = DPTrainer(model=bert(), args=arguments(tmp_path, max_steps=2), train_dataset=Records(),
                        budgets=BUDGETS, delta=1e-5)
    trainer.train()
    loader = trainer.privacy_engine.data_loader
    assert loader.physical_batch_size == 4
    assert loader.expected_batch_size == pytest.approx(8.0, rel=0.05)  # 4 rows × 2 accumulation steps
    assert trainer.args.gradient_accumulation_steps == 1 and trainer.accumulation_steps == 2
    assert trainer.privacy_engine.steps == trainer.state.global_step == 2


def test_the_loss_falls(tmp_path):
    budgets = np.full(N, 50.0)
    data = Records(n=N)
    trainer = DPTrainer(model=bert(), args=arguments(tmp_path, max_steps=30, learning_rate=2e-2, logging_steps=10),
                        train_dataset=data, budgets=budgets, delta=1e-5, method="dpsgd", seed=3)   # reproducible
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]


def test_resume_from_a_checkpoint_continues_the_ledger_exactly(tmp_path):
    def run(out, resume=None, **extra):
        args = arguments(out, max_steps=4, save_strategy="steps", save_steps=2, **extra)
        trainer = DPTrainer(model=bert(), args=args, train_dataset=Records(), budgets=BUDGETS, delta=1e-5,
                            method="hybrid")
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run(tmp_path / "whole")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-2"))
    np.testing.assert_array_equal(resumed.epsilons(), whole.epsilons())
    for (name, a), (_, b) in zip(whole.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    # the logged epoch continues too (the Trainer restarts it when it does not replay the skipped draws)
    def epochs(trainer):
        return {log["step"]: log["epoch"] for log in trainer.state.log_history if "loss" in log}
    assert epochs(resumed) == epochs(whole) and epochs(whole)[4] > epochs(whole)[2] > 0


def test_a_resumed_run_reports_the_same_final_epoch_in_its_train_summary(tmp_path):
    """Before: the summary (the log with train_runtime) kept the Trainer's own count, which restarts in a
    resumed run that does not replay the skipped draws: 1.333 instead of 2. The last step (12) is not a
    logging step, so no log with a loss sets the epoch just before the summary."""
    def final_epoch(out, resume=None):
        args = arguments(out, max_steps=-1, num_train_epochs=2, save_strategy="steps", save_steps=4,
                         logging_steps=5)
        trainer = DPTrainer(model=bert(), args=args, train_dataset=Records(), budgets=BUDGETS, delta=1e-5)
        trainer.train(resume_from_checkpoint=resume)
        (summary,) = [log for log in trainer.state.log_history if "train_runtime" in log]
        return summary["epoch"]

    assert final_epoch(tmp_path / "whole") == 2
    assert final_epoch(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-4")) == 2


def test_the_noise_seed_is_secret_not_the_public_args_seed_unless_given(tmp_path):
    """Before: the engine took args.seed (42 by default, and in every shared training script), so anyone
    could recompute the draws and the noise of a released model."""
    def engine_seeds(**extra):
        trainer = DPTrainer(model=bert(), args=arguments(tmp_path, max_steps=1), train_dataset=Records(),
                            budgets=BUDGETS, delta=1e-5, **extra)
        trainer.train()
        engine = trainer.privacy_engine
        return engine.data_loader.seed, engine.optimizer.seed

    assert engine_seeds() != engine_seeds()                 # the same args.seed
    assert engine_seeds(seed=7) == engine_seeds(seed=7)


def test_a_uniform_checkpoint_whose_record_ledger_is_not_its_runs_is_refused(tmp_path):
    from pdpfast.integrations.transformers import ENGINE_FILE

    args = arguments(tmp_path / "run", max_steps=4, save_strategy="steps", save_steps=2)
    DPTrainer(model=bert(), args=args, train_dataset=Records(), noise_multiplier=1.0, max_grad_norm=0.5,
              delta=1e-5).train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    state = torch.load(checkpoint / ENGINE_FILE, weights_only=False)
    state["uniform_ledger"]["steps_taken"] = np.int64(1)       # one step of the two left unaccounted
    torch.save(state, checkpoint / ENGINE_FILE)
    resumed = DPTrainer(model=bert(), args=arguments(tmp_path / "again", max_steps=4), train_dataset=Records(),
                        noise_multiplier=1.0, max_grad_norm=0.5, delta=1e-5)
    with pytest.raises(ValueError, match="per-record ledger holds 1 steps .* the optimizer took 2 steps"):
        resumed.train(resume_from_checkpoint=str(checkpoint))


def test_a_uniform_resume_under_another_noise_multiplier_is_refused(tmp_path):
    """Before: a σ = 1 checkpoint resumed at σ = 0.3 was accepted and its ledger went on charging σ = 1."""
    args = arguments(tmp_path / "run", max_steps=4, save_strategy="steps", save_steps=2)
    DPTrainer(model=bert(), args=args, train_dataset=Records(), noise_multiplier=1.0, max_grad_norm=0.5,
              delta=1e-5).train()
    resumed = DPTrainer(model=bert(), args=arguments(tmp_path / "again", max_steps=4), train_dataset=Records(),
                        noise_multiplier=0.3, max_grad_norm=0.5, delta=1e-5)
    with pytest.raises(ValueError, match="another sample rate or noise_multiplier"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))


def test_a_refused_resume_leaves_the_noise_seed_and_step_so_training_on_draws_no_released_noise(tmp_path):
    """Before: a resume refused for another method had already loaded the checkpoint's step count and secret
    seed into the optimizer: training again released steps 2 and 3 with the original run's noise."""
    args = arguments(tmp_path / "run", max_steps=4, save_strategy="steps", save_steps=2)
    DPTrainer(model=bert(), args=args, train_dataset=Records(), budgets=BUDGETS, delta=1e-5,
              method="sample").train()
    saved = torch.load(tmp_path / "run" / "checkpoint-2" / "optimizer.pt", weights_only=False)
    other = DPTrainer(model=bert(), args=arguments(tmp_path / "again", max_steps=4), train_dataset=Records(),
                      budgets=BUDGETS, delta=1e-5, method="scale")
    with pytest.raises(ValueError, match="plan"):
        other.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    optimizer = other.privacy_engine.optimizer
    assert optimizer.steps == 0 and optimizer.seed != saved["seed"]


def test_a_resume_refused_after_the_trainer_loaded_the_checkpoint_gives_back_its_weights_and_state(tmp_path):
    """The Trainer loads a checkpoint's weights and trainer_state.json before the optimizer's state, where
    DPTrainer's checks ran: a refused resume left the checkpoint's weights in the model (and its global
    step), which a later save_model() would have written as the trained model."""
    args = arguments(tmp_path / "run", max_steps=4, save_strategy="steps", save_steps=2)
    DPTrainer(model=bert(), args=args, train_dataset=Records(), budgets=BUDGETS, delta=1e-5,
              method="sample").train()
    other = DPTrainer(model=bert(), args=arguments(tmp_path / "again", max_steps=4), train_dataset=Records(),
                      budgets=BUDGETS, delta=1e-5, method="scale")
    before, step = parameters(other.model), other.state.global_step
    with pytest.raises(ValueError, match="plan"):
        other.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert_unchanged(other.model, before)
    assert other.state.global_step == step == 0


def test_a_roll_back_or_a_folder_without_the_engine_is_refused_before_any_weight_loads(tmp_path):
    args = arguments(tmp_path / "run", max_steps=4, save_strategy="steps", save_steps=2)
    trainer = DPTrainer(model=bert(), args=args, train_dataset=Records(), budgets=BUDGETS, delta=1e-5)
    trainer.train()
    before = parameters(trainer.model)
    with pytest.raises(ValueError, match="written after 2 steps, but this trainer has taken 4"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert_unchanged(trainer.model, before)
    assert trainer.state.global_step == 4
    (tmp_path / "run" / "checkpoint-4" / "pdpfast_engine.pt").unlink()
    fresh = DPTrainer(model=bert(), args=arguments(tmp_path / "again", max_steps=4), train_dataset=Records(),
                      budgets=BUDGETS, delta=1e-5)
    before = parameters(fresh.model)
    with pytest.raises(FileNotFoundError, match="holds no pdpfast_engine.pt"):
        fresh.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert_unchanged(fresh.model, before)


def test_two_continuations_of_a_checkpoint_with_other_learning_rates_draw_their_own_noise(tmp_path):
    """A checkpoint keeps the noise seed, and the noise of step t comes from (seed, t): a continuation with
    another learning rate added the same noise as the run going on, and their difference was noise-free.
    Another learning rate now draws new seeds; the same settings keep them (an exact continuation)."""
    args = arguments(tmp_path / "run", max_steps=4, save_strategy="steps", save_steps=2, learning_rate=5e-3)
    DPTrainer(model=bert(), args=args, train_dataset=Records(), budgets=BUDGETS, delta=1e-5).train()
    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    saved = torch.load(tmp_path / "run" / "checkpoint-2" / "pdpfast_engine.pt", weights_only=False)

    def seeds_of_a_continuation(lr):
        trainer = DPTrainer(model=bert(), args=arguments(tmp_path / f"lr{lr}", max_steps=4, learning_rate=lr),
                            train_dataset=Records(), budgets=BUDGETS, delta=1e-5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train(resume_from_checkpoint=checkpoint)
        said = any("this continuation draws its own records and noise" in str(w.message) for w in caught)
        return (trainer.privacy_engine.optimizer.seed, trainer.privacy_engine.data_loader.seed), said

    same, said_same = seeds_of_a_continuation(5e-3)
    other, said_other = seeds_of_a_continuation(2e-2)
    assert same == (saved["optimizer"]["seed"], saved["loader"]["seed"]) and not said_same
    assert other[0] != same[0] and other[1] != same[1] and said_other


def test_a_continuation_label_draws_its_own_noise_for_a_change_the_trainer_cannot_see(tmp_path):
    args = arguments(tmp_path / "run", max_steps=4, save_strategy="steps", save_steps=2)
    DPTrainer(model=bert(), args=args, train_dataset=Records(), budgets=BUDGETS, delta=1e-5).train()
    checkpoint = str(tmp_path / "run" / "checkpoint-2")

    def seeds(name, **train):
        trainer = DPTrainer(model=bert(), args=arguments(tmp_path / name, max_steps=4), train_dataset=Records(),
                            budgets=BUDGETS, delta=1e-5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train(resume_from_checkpoint=checkpoint, **train)
        return trainer.privacy_engine.optimizer.seed, trainer.privacy_engine.data_loader.seed

    plain, a, again, b = (seeds("plain"), seeds("a", continuation="new collator"),
                          seeds("a2", continuation="new collator"), seeds("b", continuation="new model code"))
    assert a == again and len({plain, a, b}) == 3
    fresh = DPTrainer(model=bert(), args=arguments(tmp_path / "fresh", max_steps=4), train_dataset=Records(),
                      budgets=BUDGETS, delta=1e-5)
    with pytest.raises(ValueError, match="continuation= names a continuation of a checkpoint"):
        fresh.train(continuation="x")
    with pytest.raises(TypeError, match="continuation must be a string"):
        fresh.train(resume_from_checkpoint=checkpoint, continuation=3)


def test_uniform_dp_with_a_noise_multiplier(tmp_path):
    trainer = DPTrainer(model=bert(), args=arguments(tmp_path, max_steps=3), train_dataset=Records(),
                        noise_multiplier=1.0, max_grad_norm=0.5, delta=1e-5)
    trainer.train()
    eps = trainer.epsilons()
    assert eps.shape == (N,) and np.all(eps == eps[0]) and eps[0] > 0


def test_budgets_from_a_column_name(tmp_path):
    datasets = pytest.importorskip("datasets")
    data = Records()
    table = datasets.Dataset.from_dict({"input_ids": data.ids.tolist(), "attention_mask": [[1] * T] * N,
                                        "labels": data.labels.tolist(), "epsilon": BUDGETS.tolist()})
    trainer = DPTrainer(model=bert(), args=arguments(tmp_path, max_steps=2), train_dataset=table.with_format("torch"),
                        budgets="epsilon", delta=1e-5)
    trainer.train()
    assert np.all(trainer.epsilons() <= BUDGETS)


def parameters(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_unchanged(model, before):
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0, msg=name)


def refused_when_built(tmp_path, error, match, **settings):
    """DPTrainer(**settings) raises ``error`` matching ``match``, and the model is left as it was."""
    model = bert()
    before = parameters(model)
    options = dict(args=arguments(tmp_path), train_dataset=Records())
    options.update(settings)
    with pytest.raises(error, match=match):
        DPTrainer(model=model, **options)
    assert_unchanged(model, before)


@pytest.mark.parametrize("budgets,error,match", [
    (BUDGETS[:-1], ValueError, r"budgets must have one value per training record \(48\)"),
    (np.r_[BUDGETS[:-1], 0.0], ValueError, "budgets must be finite and > 0"),
    (np.r_[BUDGETS[:-1], -1.0], ValueError, "budgets must be finite and > 0"),
    (np.r_[BUDGETS[:-1], np.nan], ValueError, "budgets must be finite and > 0"),
    (np.r_[BUDGETS[:-1], np.inf], ValueError, "budgets must be finite and > 0"),
    (np.array([]), ValueError, "budgets is empty"),
    (BUDGETS.reshape(2, -1), ValueError, "budgets must be 1-D"),
    (["2.0"] * N, TypeError, "budgets must be numbers"),
    ([True] * N, TypeError, "budgets must be numbers"),
    ("epsilon", ValueError, "budgets='epsilon' names a column of a datasets.Dataset, but train_dataset is a Records"),
], ids=["short", "zero", "negative", "nan", "inf", "empty", "2d", "strings", "bools", "column-of-no-table"])
def test_dptrainer_refuses_bad_budgets_when_built(tmp_path, budgets, error, match):
    refused_when_built(tmp_path, error, match, budgets=budgets)


def test_dptrainer_refuses_a_missing_budget_column_when_built(tmp_path):
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"input_ids": Records().ids.tolist(), "labels": [0] * N})
    refused_when_built(tmp_path, ValueError, "budgets='epsilon' names a column, but train_dataset has no such column",
                       train_dataset=table, budgets="epsilon")


@pytest.mark.parametrize("settings,error,match", [
    (dict(delta=0.0), ValueError, r"delta must lie in \(0, 1\)"),
    (dict(delta=1.0), ValueError, r"delta must lie in \(0, 1\)"),
    (dict(delta=1.5), ValueError, r"delta must lie in \(0, 1\)"),
    (dict(delta=float("nan")), ValueError, r"delta must lie in \(0, 1\)"),
    (dict(delta="1e-5"), TypeError, "delta must be a number"),
    (dict(max_grad_norm=0.0), ValueError, "max_grad_norm must be a finite number > 0"),
    (dict(max_grad_norm=-1.0), ValueError, "max_grad_norm must be a finite number > 0"),
    (dict(max_grad_norm=float("inf")), ValueError, "max_grad_norm must be a finite number > 0"),
    (dict(max_grad_norm=[1.0, 2.0]), TypeError, "max_grad_norm must be a number"),
    (dict(method="fast"), ValueError, "method must be one of 'sample', 'scale', 'hybrid', 'dpsgd', got 'fast'"),
    (dict(accountant="prv"), ValueError, "accountant must be one of 'rdp', 'pld', got 'prv'"),
    (dict(mode="hooks"), ValueError, "mode must be one of 'bk', 'ghost', got 'hooks'"),
    (dict(clipping="adaptive"), ValueError, "clipping must be one of 'flat', 'per_layer', got 'adaptive'"),
    (dict(seed=-1), ValueError, "seed must be an int ≥ 0"),
    (dict(per_sample_loss="mse"), TypeError, "per_sample_loss must be a function"),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_dptrainer_refuses_bad_dp_settings_when_built(tmp_path, settings, error, match):
    refused_when_built(tmp_path, error, match, budgets=BUDGETS, **settings)


@pytest.mark.parametrize("sigma,error", [(-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                                         ("1.0", TypeError)])
def test_dptrainer_refuses_a_bad_noise_multiplier_when_built(tmp_path, sigma, error):
    refused_when_built(tmp_path, error, "noise_multiplier must be a", noise_multiplier=sigma)


def test_dptrainer_refuses_neither_or_both_of_budgets_and_noise_multiplier_when_built(tmp_path):
    refused_when_built(tmp_path, ValueError, "give budgets=.*or noise_multiplier=.*exactly one")
    refused_when_built(tmp_path, ValueError, "give budgets=.*or noise_multiplier=.*exactly one", budgets=BUDGETS,
                       noise_multiplier=1.0)


@pytest.mark.parametrize("name,value", [("method", "sample"), ("method", "dpsgd"), ("accountant", "rdp"),
                                        ("accountant", "pld")])
def test_dptrainer_refuses_budget_only_arguments_with_a_noise_multiplier(tmp_path, name, value):
    refused_when_built(tmp_path, ValueError, rf"{name}='{value}' applies to individualized DP \(budgets=\) only",
                       noise_multiplier=1.0, **{name: value})


def test_dptrainer_method_and_accountant_default_to_sample_and_rdp_with_budgets(tmp_path):
    trainer = DPTrainer(model=bert(), args=arguments(tmp_path), train_dataset=Records(), budgets=BUDGETS)
    assert (trainer.method, trainer.dp_accountant) == ("sample", "rdp")
    trainer = DPTrainer(model=bert(), args=arguments(tmp_path), train_dataset=Records(), noise_multiplier=1.0)
    assert (trainer.method, trainer.dp_accountant) == (None, None)  # uniform DP has no plan to read them


def test_dptrainer_refuses_bad_training_setup_when_built(tmp_path):
    refused_when_built(tmp_path, ValueError, "DPTrainer needs args=", budgets=BUDGETS, args=None)
    refused_when_built(tmp_path, TypeError, "args must be a transformers.TrainingArguments", budgets=BUDGETS,
                       args=dict(output_dir=str(tmp_path)))
    refused_when_built(tmp_path, ValueError, "DPTrainer needs train_dataset=", budgets=BUDGETS, train_dataset=None)
    refused_when_built(tmp_path, ValueError, "train_dataset is empty", noise_multiplier=1.0,
                       train_dataset=Records(n=0))
    refused_when_built(tmp_path, TypeError, "train_dataset must have a length", noise_multiplier=1.0,
                       train_dataset=iter(Records()))
    refused_when_built(tmp_path, ValueError, r"expected batch .*per_device_train_batch_size × "
                       r"gradient_accumulation_steps = 8\) is larger than train_dataset \(6 records\)",
                       noise_multiplier=1.0, train_dataset=Records(n=6))
    refused_when_built(tmp_path, ValueError, "num_train_epochs must be a positive whole number", budgets=BUDGETS,
                       args=arguments(tmp_path, max_steps=-1, num_train_epochs=1.5))


def test_dptrainer_construction_does_no_training(tmp_path):
    for settings in (dict(budgets=BUDGETS, method="hybrid"), dict(noise_multiplier=1.0)):
        model = bert()
        before = parameters(model)
        trainer = DPTrainer(model=model, args=arguments(tmp_path), train_dataset=Records(), **settings)
        assert_unchanged(model, before)
        assert trainer.state.global_step == 0 and trainer.privacy_engine.steps == 0
        assert trainer.privacy_engine.state is None and trainer.optimizer is None  # not made private yet
        with pytest.raises(RuntimeError, match="known once training has started"):
            trainer.epsilons()


def test_dptrainer_checks_a_train_dataset_set_after_construction_at_train(tmp_path):
    model = bert()
    trainer = DPTrainer(model=model, args=arguments(tmp_path), train_dataset=Records(), budgets=BUDGETS)
    trainer.train_dataset = Records(n=N - 1)  # only now do the budgets no longer match the records
    before = parameters(model)
    with pytest.raises(ValueError, match=r"budgets must have one value per training record \(47\)"):
        trainer.train()
    assert_unchanged(model, before)


def test_dptrainer_allows_a_zero_noise_multiplier_and_reports_infinite_epsilon(tmp_path):
    trainer = DPTrainer(model=bert(), args=arguments(tmp_path, max_steps=1), train_dataset=Records(),
                        noise_multiplier=0.0)
    trainer.train()
    assert np.all(np.isinf(trainer.epsilons()))


def test_per_sample_loss_of_a_causal_lm_ignores_padding_and_is_per_record():
    model = gpt2()
    ids = torch.randint(3, VOCAB, (3, T))
    labels = ids.clone()
    labels[1, 5:] = -100
    out = model(input_ids=ids)
    losses = default_per_sample_loss(model)(out, labels)
    for i in range(3):
        alone = default_per_sample_loss(model)(model(input_ids=ids[i:i + 1]), labels[i:i + 1])
        torch.testing.assert_close(losses[i:i + 1], alone, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ per-record losses against the model's own


def test_per_record_loss_of_a_peft_causal_lm_without_task_type_is_shifted_as_the_models_own():
    """Before: get_peft_model(gpt2, LoraConfig(...)) without task_type is a plain PeftModel, which the class-name
    check took for token classification: each position was trained to predict its own token."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True)
    model = peft.get_peft_model(gpt2(), config)
    assert type(model).__name__ == "PeftModel"
    ids = torch.randint(3, VOCAB, (3, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
        per_record = default_per_sample_loss(model)(out, ids)
    assert per_record.shape == (3,)
    torch.testing.assert_close(per_record.mean(), out.loss, rtol=1e-5, atol=1e-6)


def bert_with(num_labels, problem_type):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=num_labels,
                                     problem_type=problem_type, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


@pytest.mark.parametrize("num_labels,problem_type", [(3, "multi_label_classification"), (3, None),
                                                     (3, "regression"), (1, "regression")],
                         ids=["multi-label", "multi-label-inferred", "regression-3", "regression-1"])
def test_per_record_loss_of_float_label_heads_averages_to_the_models_own(num_labels, problem_type):
    """Before: float labels (B, C) (multi-label classification) failed with a raw RuntimeError."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (4, T), generator=g)
    if problem_type == "regression":
        labels = torch.randn(4, num_labels, generator=g).squeeze(-1)
    else:
        labels = torch.randint(0, 2, (4, num_labels), generator=g).float()
    model = bert_with(num_labels, problem_type)
    with torch.no_grad():
        own = model(input_ids=ids, labels=labels).loss
        model.config.problem_type = problem_type  # as DPTrainer finds it: its forwards carry no labels
        per_record = default_per_sample_loss(model)(model(input_ids=ids), labels)
    assert per_record.shape == (4,)
    torch.testing.assert_close(per_record.mean(), own, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("labels", [[1, 0, 3, 2], [0, 0, 0, 0]], ids=["ints", "zeros"])
def test_one_logit_with_integer_labels_is_regression_as_the_models_own_loss(labels):
    """Before: cross-entropy over one class, "Target 1 is out of bounds", or, for labels all 0, a loss of 0
    that trained nothing; the model's own rule is num_labels = 1 → squared error, whatever the dtype."""
    ids = torch.randint(3, VOCAB, (4, T), generator=torch.Generator().manual_seed(3))
    labels = torch.tensor(labels)
    model = bert_with(1, None)
    with torch.no_grad():
        own = model(input_ids=ids, labels=labels).loss
        model.config.problem_type = None   # as DPTrainer finds it: its forwards carry no labels
        per_record = default_per_sample_loss(model)(model(input_ids=ids), labels)
    assert per_record.shape == (4,) and torch.all(per_record > 0)
    torch.testing.assert_close(per_record.mean(), own, rtol=1e-5, atol=1e-6)


def test_a_multi_label_model_trains_within_its_budgets(tmp_path):
    class MultiLabel(Records):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            item["labels"] = torch.stack([self.ids[i, 0] % 2, self.ids[i, 1] % 2]).float()
            return item

    trainer = DPTrainer(model=bert_with(2, "multi_label_classification"), args=arguments(tmp_path, max_steps=2),
                        train_dataset=MultiLabel(), budgets=BUDGETS, delta=1e-5)
    trainer.train()
    assert trainer.privacy_engine.steps == 2 and np.all(trainer.epsilons() <= BUDGETS)


# ------------------------------------------------------------------ Trainer settings DP would silently ignore


@pytest.mark.parametrize("overrides,match", [
    (dict(max_grad_norm=0.01), r"TrainingArguments.max_grad_norm=0.01 .*DPTrainer\(max_grad_norm=0.01\)"),
    (dict(label_smoothing_factor=0.1), r"label_smoothing_factor=0.1 .*per_sample_loss="),
    (dict(fp16=True), r"fp16=True .*use bf16=True"),
    (dict(save_only_model=True), r"save_only_model=True .*pdpfast_engine.pt"),
    (dict(dataloader_drop_last=True), r"dataloader_drop_last=True .*never dropped"),
    (dict(train_sampling_strategy="group_by_length"), r"train_sampling_strategy='group_by_length'"),
    (dict(train_sampling_strategy="sequential"), r"train_sampling_strategy='sequential'"),
    (dict(dataloader_persistent_workers=True), r"dataloader_persistent_workers=True needs dataloader_num_workers"),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_training_arguments_dp_would_ignore_are_refused_naming_them(tmp_path, overrides, match):
    refused_when_built(tmp_path, ValueError, match, budgets=BUDGETS, args=arguments(tmp_path, **overrides))


def test_training_arguments_max_grad_norm_is_accepted_at_its_default_off_or_equal_to_the_dp_clip_norm(tmp_path):
    for clip, dp_clip in ((1.0, 0.5), (0.0, 0.5), (0.5, 0.5)):
        trainer = DPTrainer(model=bert(), args=arguments(tmp_path, max_grad_norm=clip), train_dataset=Records(),
                            budgets=BUDGETS, max_grad_norm=dp_clip)
        assert trainer.dp_max_grad_norm == dp_clip and trainer.args.max_grad_norm == 0.0


def test_compute_loss_func_is_refused_pointing_to_per_sample_loss(tmp_path):
    """Before: it was accepted and never called."""
    def loss(outputs, labels, num_items_in_batch=None):
        return 1000.0 * torch.nn.functional.cross_entropy(outputs.logits, labels)

    refused_when_built(tmp_path, ValueError, r"compute_loss_func= .*per_sample_loss=", budgets=BUDGETS,
                       compute_loss_func=loss)


def test_dataloader_worker_settings_reach_the_poisson_loader(tmp_path):
    """Before: dataloader_prefetch_factor and dataloader_persistent_workers were dropped from the loader."""
    args = arguments(tmp_path, dataloader_num_workers=1, dataloader_prefetch_factor=3,
                     dataloader_persistent_workers=True, dataloader_pin_memory=False)
    trainer = DPTrainer(model=bert(), args=args, train_dataset=Records(), budgets=BUDGETS)
    trainer.get_train_dataloader()  # makes the run private; no worker is started before iterating
    inner = trainer.privacy_engine.data_loader._loader
    assert (inner.num_workers, inner.prefetch_factor, inner.persistent_workers) == (1, 3, True)
