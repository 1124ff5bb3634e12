"""Data parallelism: what the ranks must agree on, refused clearly when they do not (2 gloo processes, CPU).

Each case once failed silently or hung: noise generators seeded per rank (the models drift apart), a seed
given on some ranks only (a hang until the process group's timeout), ranks resuming from different
checkpoints, a non-finite record in one rank's share (only that rank discarded the draw), a model not
wrapped in DistributedDataParallel (independent runs). One spawn runs every scenario in turn; each test
reads its own outcome. Also here: Opacus's adaptive-clipping arguments and ``no_host_sync``'s coverage.
"""
from __future__ import annotations

import datetime
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pdpfast
from pdpfast.distributed import leave_process_group

N, SEED, BAD = 30, 3, 4   # record BAD holds a NaN feature in the "nan" scenario
STEPS = 8


def data(with_nan: bool = False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 5, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, 3, (N,), generator=g)
    if with_nan:
        x[BAD] = float("nan")
    return TensorDataset(x, y)


def model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def make_private(net, engine, **kwargs):
    args = dict(noise_multiplier=1.0, max_grad_norm=1.0, sample_rates=0.3, steps_per_epoch=STEPS)
    args.update(kwargs)
    dataset = args.pop("dataset", None)
    dataset = data() if dataset is None else dataset
    return engine.make_private(module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                               data_loader=DataLoader(dataset, batch_size=5), **args)


def params(net):
    inner = net.module if isinstance(net, nn.parallel.DistributedDataParallel) else net
    return torch.cat([p.detach().reshape(-1) for p in inner.parameters()])


def train_with_recovery(net, engine, optimizer, loader):
    """README's recovery from a non-finite record: catch, zero_grad() (discard the draw), step()."""
    dropped, messages = [], []
    for x, y in loader:
        try:
            nn.functional.cross_entropy(net(x), y).backward()
        except FloatingPointError as exc:
            dropped.append(engine.data_loader.current.step)
            messages.append(str(exc))
            optimizer.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    return params(net), dropped, messages


def train_until_refused(net, engine, optimizer, loader):
    """A loop that meets the deferred check (norms not read in the backward): (params, the loader's step
    refused first or None, its message) after the first refusal, or after the run and its final wait."""
    for x, y in loader:
        nn.functional.cross_entropy(net(x), y).backward()
        try:
            optimizer.step()
        except FloatingPointError as exc:
            return params(net), engine.data_loader.current.step, str(exc)
        optimizer.zero_grad()
    try:
        engine.state.check_finite(wait=True)
    except FloatingPointError as exc:
        return params(net), "end", str(exc)
    return params(net), None, None


def train_skipping_empty_batches(net, optimizer, loader):
    """``pdpfast train``'s loop: no forward or backward for a batch of 0 rows (the step adds noise only)."""
    for x, y in loader:
        if x.shape[0]:
            nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return params(net)


def _run_scenario(rank, out_dir, scenario):
    ddp = nn.parallel.DistributedDataParallel
    if scenario == "noise_generator_per_rank":
        net = ddp(model())
        make_private(net, pdpfast.PrivacyEngine(seed=1), noise_generator=torch.Generator().manual_seed(100 + rank))
        return "no error"
    if scenario == "noise_generator_same":
        net = ddp(model())
        net, optimizer, loader = make_private(net, pdpfast.PrivacyEngine(seed=1),
                                              noise_generator=torch.Generator().manual_seed(100))
        for x, y in loader:
            nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        return params(net)
    if scenario in ("seed_on_rank_1_only", "seed_on_rank_0_only"):
        given = 1 if scenario == "seed_on_rank_1_only" else 0
        make_private(ddp(model()), pdpfast.PrivacyEngine(seed=5 if rank == given else None))
        return "no error"
    if scenario == "seed_on_no_rank":
        net, *_ = make_private(ddp(model()), engine := pdpfast.PrivacyEngine())
        return engine.seed
    if scenario.startswith("resume"):
        def run(stop_at=None, load=None):
            engine = pdpfast.PrivacyEngine(seed=4)
            net, optimizer, loader = make_private(ddp(model()), engine)
            if load:
                engine.load_checkpoint(load, net)
            for x, y in loader:
                nn.functional.cross_entropy(net(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                if engine.steps == stop_at:
                    engine.save_checkpoint(os.path.join(out_dir, f"ck{stop_at}.pt"), net)
                    break
            return params(net)
        if scenario == "resume_save":
            run(stop_at=1)
            run(stop_at=2)
            return "saved"
        if scenario == "resume_same":
            return run(load=os.path.join(out_dir, "ck2.pt"))
        if scenario == "resume_different":
            run(load=os.path.join(out_dir, f"ck{2 - rank}.pt"))
            return "no error"
        if scenario == "resume_unreadable_on_rank_1":
            run(load=os.path.join(out_dir, "ck2.pt" if rank == 0 else "missing.pt"))
            return "no error"
    if scenario == "nan":
        net, optimizer, loader = make_private(ddp(model()), engine := pdpfast.PrivacyEngine(seed=SEED),
                                              dataset=data(with_nan=True))
        return train_with_recovery(net, engine, optimizer, loader)
    if scenario.startswith("nan_deferred"):
        import pdpfast.clipping as clipping

        # a GPU's route on the CPU: norms not read in the backward, but queued and read at a step
        saved = clipping.DEFERRED_CHECK_DEVICES, clipping.CHECK_FINITE_ON_CPU
        clipping.DEFERRED_CHECK_DEVICES, clipping.CHECK_FINITE_ON_CPU = ("cpu",), False
        try:
            if scenario == "nan_deferred_in_later_batches":  # every record drawn, five a physical batch: rank 0's
                dataset = data()                                    # first holds record 4, rank 1's second 13
                dataset.tensors[0][[4, 13]] = float("nan")
                kwargs = dict(sample_rates=1.0, physical_batch_size=5)
            else:
                dataset, kwargs = data(with_nan=scenario == "nan_deferred"), {}
            net, optimizer, loader = make_private(ddp(model()), engine := pdpfast.PrivacyEngine(seed=SEED),
                                                  dataset=dataset, **kwargs)
            return train_until_refused(net, engine, optimizer, loader)
        finally:
            clipping.DEFERRED_CHECK_DEVICES, clipping.CHECK_FINITE_ON_CPU = saved
    if scenario == "empty_shares":  # ~1.2 records a draw: a rank's share is often empty, the other's not
        net, optimizer, loader = make_private(ddp(model()), pdpfast.PrivacyEngine(seed=SEED), sample_rates=0.04,
                                              steps_per_epoch=20)
        return train_skipping_empty_batches(net, optimizer, loader)
    if scenario == "not_wrapped":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_private(model(), pdpfast.PrivacyEngine(seed=1))
        return [str(w.message) for w in caught]
    if scenario == "wrapped_after":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net, optimizer, loader = make_private(model(), pdpfast.PrivacyEngine(seed=1))
        wrapper = ddp(net)
        x, y = next(iter(loader))
        nn.functional.cross_entropy(wrapper(x), y).backward()
        return "no error"
    raise AssertionError(scenario)


# the ranks resuming apart and the seeds given on some ranks only come last: before their fixes they hung until
# the process group's timeout, which broke the group for every scenario after them
SCENARIOS = ["noise_generator_per_rank", "noise_generator_same", "seed_on_no_rank", "resume_save", "resume_same",
             "nan", "nan_deferred", "nan_deferred_clean", "nan_deferred_in_later_batches", "empty_shares",
             "not_wrapped", "wrapped_after", "resume_different", "resume_unreadable_on_rank_1", "seed_on_rank_1_only",
             "seed_on_rank_0_only"]


def _worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    outcomes = {}
    try:
        for scenario in SCENARIOS:
            try:
                outcomes[scenario] = _run_scenario(rank, out_dir, scenario)
            except Exception as exc:
                outcomes[scenario] = f"{type(exc).__name__}: {exc}"
            torch.save(outcomes, os.path.join(out_dir, f"rank{rank}.pt"))  # what ran, should a later one hang
    finally:
        leave_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agreement")
    try:
        mp.spawn(_worker, args=(str(tmp / "init"), str(tmp)), nprocs=2, join=True)
    except Exception:  # a scenario broke the process group: the tests of the others still read theirs
        pass
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) if (tmp / f"rank{r}.pt").exists() else {}
            for r in (0, 1)]


def _both(outcomes, scenario):
    return [outcomes[r].get(scenario, "did not run (a previous scenario broke the process group)") for r in (0, 1)]


def test_noise_generators_that_differ_between_ranks_are_refused_naming_noise_generator(outcomes):
    """Before: each rank added its own generator's noise to the same summed gradients (models 0.35 apart)."""
    for message in _both(outcomes, "noise_generator_per_rank"):
        assert message.startswith("ValueError") and "noise_generator differs between ranks" in message, message


def test_the_same_noise_generator_on_every_rank_trains_one_model(outcomes):
    p0, p1 = _both(outcomes, "noise_generator_same")
    assert isinstance(p0, torch.Tensor), p0
    torch.testing.assert_close(p0, p1, rtol=0, atol=0)


@pytest.mark.parametrize("scenario", ["seed_on_rank_1_only", "seed_on_rank_0_only"])
def test_a_seed_given_on_some_ranks_only_is_refused_not_a_hang(outcomes, scenario):
    """Before: the ranks given None broadcast while the others gathered, until the process group's timeout."""
    for message in _both(outcomes, scenario):
        assert message.startswith("ValueError") and "seed differs between ranks" in message, message
        assert "None" in message


def test_no_seed_on_any_rank_agrees_on_one_drawn_by_rank_0(outcomes):
    s0, s1 = _both(outcomes, "seed_on_no_rank")
    assert isinstance(s0, int) and s0 == s1


def test_ranks_resuming_from_the_same_checkpoint_agree(outcomes):
    p0, p1 = _both(outcomes, "resume_same")
    assert isinstance(p0, torch.Tensor), p0
    torch.testing.assert_close(p0, p1, rtol=0, atol=0)


def test_ranks_resuming_from_different_checkpoints_are_refused(outcomes):
    """Before: rank 0 resumed at step 2, rank 1 at step 1; they then summed different draws' gradients."""
    for message in _both(outcomes, "resume_different"):
        assert message.startswith("ValueError") and "checkpoint differs between ranks" in message, message
        assert "2 steps" in message and "1 steps" in message


def test_a_rank_that_cannot_read_its_checkpoint_makes_every_rank_refuse(outcomes):
    first, second = _both(outcomes, "resume_unreadable_on_rank_1")
    assert second.startswith("FileNotFoundError"), second
    assert first.startswith("ValueError") and "rank 1 refused its checkpoint" in first, first


def test_a_non_finite_record_makes_every_rank_discard_the_draw_as_one_process_does(outcomes):
    """Before: only the rank whose share held the NaN record raised; the other released its share of the
    draw, so the 2-rank run was 0.01 away from the single-process run with the same seed."""
    net, optimizer, loader = make_private(model(), engine := pdpfast.PrivacyEngine(seed=SEED),
                                          dataset=data(with_nan=True))
    single, single_dropped, _ = train_with_recovery(net, engine, optimizer, loader)
    assert single_dropped  # the record was drawn
    for rank, result in enumerate(_both(outcomes, "nan")):
        assert isinstance(result, tuple), result
        p, dropped, messages = result
        assert dropped == single_dropped, f"rank {rank}"
        torch.testing.assert_close(p, single, rtol=1e-12, atol=1e-12, msg=f"rank {rank}")
    own = [m for r in (0, 1) for m in _both(outcomes, "nan")[r][2] if f"record(s) (dataset records [{BAD}]" in m]
    elsewhere = [m for r in (0, 1) for m in _both(outcomes, "nan")[r][2] if "another rank's share" in m]
    assert len(own) == len(elsewhere) == len(single_dropped)  # per draw: one rank holds it, the other is told


def test_with_deferred_checks_every_rank_refuses_the_step_after_a_nonfinite_draw(outcomes):
    """A GPU's norms reach the host without stopping it, so each rank would read them at its own pace.
    Before: under torch.distributed the deferred check was off, and a non-finite record turned every rank's
    model NaN unreported. Now each backward's flag is summed over the ranks and every rank reads it at the
    step after the draw's: the same step is refused on both ranks, one naming the record, the other told
    that another rank's share held it, and the ranks keep equal parameters."""
    net, optimizer, loader = make_private(model(), engine := pdpfast.PrivacyEngine(seed=SEED),
                                          dataset=data(with_nan=True))
    _, single_dropped, _ = train_with_recovery(net, engine, optimizer, loader)
    (p0, step0, m0), (p1, step1, m1) = [r if isinstance(r, tuple) else (None, r, r) for r in _both(outcomes,
                                                                                                 "nan_deferred")]
    assert step0 == step1 == single_dropped[0] + 1, (step0, step1, single_dropped)
    messages = sorted([m0, m1], key=lambda m: "another rank's share" in m)
    assert f"in an earlier draw, 1 record(s) (dataset records [{BAD}]" in messages[0], messages
    assert "in an earlier draw, another rank's share of the draw holds a record" in messages[1], messages
    assert all("every rank reads the norms after their draw's step" in m for m in messages)
    torch.testing.assert_close(p0, p1, rtol=0, atol=0, equal_nan=True)


def test_with_deferred_checks_each_rank_names_its_own_record_though_another_ranks_was_read_first(outcomes):
    """Rank 1 reads its first physical batch's check first: the summed flag says another rank's share holds a
    non-finite record, but its own second batch holds one too. Before: it said only "another rank's share",
    and record 13 was named on no rank."""
    (_, step0, m0), (_, step1, m1) = _both(outcomes, "nan_deferred_in_later_batches")
    assert step0 == step1 == 1, (m0, m1)
    assert "dataset records [4]" in m0 and "dataset records [13]" in m1, (m0, m1)


def test_with_deferred_checks_clean_ranks_train_to_the_end_unrefused(outcomes):
    (p0, step0, m0), (p1, step1, m1) = _both(outcomes, "nan_deferred_clean")
    assert step0 is None and step1 is None, (m0, m1)
    assert torch.isfinite(p0).all()
    torch.testing.assert_close(p0, p1, rtol=0, atol=0)


def test_a_loop_that_skips_empty_batches_trains_the_single_process_model_with_empty_shares(outcomes):
    """Before: a rank whose share of a draw was empty skipped its backward while the other ran it, and the
    collective in the backward (the non-finite flag) met the gradients' sum: gloo aborted ("collective
    mismatch"; ``pdpfast train --nproc 2`` with small batches did). Now an empty share is one masked row."""
    net, optimizer, loader = make_private(model(), pdpfast.PrivacyEngine(seed=SEED), sample_rates=0.04,
                                          steps_per_epoch=20)
    single = train_skipping_empty_batches(net, optimizer, loader)
    p0, p1 = _both(outcomes, "empty_shares")
    assert isinstance(p0, torch.Tensor) and isinstance(p1, torch.Tensor), (p0, p1)
    torch.testing.assert_close(p0, p1, rtol=0, atol=0)
    torch.testing.assert_close(p0, single, rtol=1e-12, atol=1e-12)


def test_a_model_not_wrapped_in_ddp_inside_a_process_group_is_warned_about(outcomes):
    """Before: each rank trained its own model, with its own draws and noise, silently."""
    for caught in _both(outcomes, "not_wrapped"):
        assert isinstance(caught, list), caught
        assert any("not wrapped in DistributedDataParallel" in m and "independent single-process run" in m
                   for m in caught), caught


def test_a_ddp_wrapper_made_after_make_private_is_refused_at_its_forward(outcomes):
    """Before: DDP's reducer failed at the second step with an unrelated message, or (find_unused_parameters)
    the ranks trained apart silently."""
    for message in _both(outcomes, "wrapped_after"):
        assert message.startswith("RuntimeError") and "wrapped in DistributedDataParallel after make_private" \
            in message, message


# ---------------------------------------------------------------- one process: Opacus's arguments, no_host_sync

def _opacus_call(**extra):
    m = nn.Linear(4, 2)
    loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=8)
    return dict(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), data_loader=loader,
                max_grad_norm=1.0, **extra)


ADAPTIVE = dict(target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0, min_clipbound=0.1,
                unclipped_num_std=1.0)


@pytest.mark.parametrize("clipping", ["adaptive", "flat"])
@pytest.mark.parametrize("entry", ["make_private", "make_private_with_epsilon"])
def test_opacus_adaptive_clipping_arguments_are_refused_as_adaptive_clipping(entry, clipping):
    """Before: Python's "unexpected keyword argument 'target_unclipped_quantile'" TypeError."""
    engine = pdpfast.PrivacyEngine()
    size = dict(noise_multiplier=1.0) if entry == "make_private" else dict(target_epsilon=3.0, target_delta=1e-5,
                                                                          epochs=1)
    with pytest.raises(ValueError, match="clipping='adaptive' is not offered") as info:
        getattr(engine, entry)(**_opacus_call(clipping=clipping, **size, **ADAPTIVE))
    assert "target_unclipped_quantile" in str(info.value) or clipping == "adaptive"
    assert engine.state is None  # nothing was made private


def test_other_unknown_arguments_stay_a_type_error_naming_them():
    with pytest.raises(TypeError, match="unexpected keyword argument.*'noise_multipler'"):
        pdpfast.PrivacyEngine().make_private(**_opacus_call(noise_multiplier=1.0, noise_multipler=1.0))


def test_no_host_sync_refuses_allclose_and_histc_without_a_range():
    """Before: torch.allclose (a Python bool, read from the device) passed the guard: the dispatcher sees
    one aten::allclose, and the read inside it runs with the guard's mode popped."""
    from pdpfast.graphs import no_host_sync

    x = torch.randn(7, generator=torch.Generator().manual_seed(1))
    with no_host_sync():
        with pytest.raises(RuntimeError, match="aten::allclose synchronises"):
            torch.allclose(x, x)
        with pytest.raises(RuntimeError, match="aten::histc synchronises"):
            torch.histc(x, bins=5)           # min == max: CUDA reads the input's min and max on the host
        ranged = torch.histc(x, bins=5, min=-3.0, max=3.0)  # a range given: no read
    assert ranged.shape == (5,)
