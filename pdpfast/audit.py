"""Empirical privacy audit in one training run, per privacy group (Steinke, Nasr & Jagielski,
"Privacy Auditing with One (1) Training Run", NeurIPS 2023).

m canary records are added to the training data; each is *included* independently with
probability 1/2 (excluded canaries are never drawn), and each belongs to a privacy group, whose
budget ε_g gives it the group's (q_g, c_g). After one training run the auditor scores every canary,
guesses "included" for the highest scores and "excluded" for the lowest, and counts correct
guesses. If training is (ε, δ)-DP for the canaries, k correct guesses out of r are unlikely beyond
what ε allows; the largest ε that the count rejects at the chosen confidence is an empirical
*lower bound* on the ε the run really spends. A lower bound above the budget means a bug (no
clipping, no noise, a wrong accountant); a bound below it is evidence, not proof, that the
guarantee holds (the audit is only as strong as its attack).

The attack here is white-box, the strongest the setting allows. Canaries are *Dirac input
canaries*: the model is the demo's MLP with one extra input per canary, canary i is a large value
on its own input (0 for every real record) with a random label. Its gradient on the first layer
then lives in a column no other record touches, so that column moves only by canary i's clipped
contribution and the noise. The auditor sees every iterate and scores canary i by how far each
update moved its column along its own gradient direction, summed over steps. Canaries are
ordinary training records to the engine: Poisson sampling, per-sample clipping and noise apply
to them exactly as to the data.

The plan is fixed before the inclusion coin flips: it is calibrated on the data plus all m
canaries, excluded canaries get sample rate 0, and the gradient is normalized by the plan's
expected batch size. The mechanism audited is therefore exactly the one the accountant certifies.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ._checks import as_float_array, check_choice, check_delta, check_in_range, check_int, check_positive

AUDITED_METHODS = ("sample", "scale", "hybrid", "dpsgd", "non-private")
BROKEN = (None, "no-clipping", "no-noise")
# numbers of guesses tried, as fractions of a group's canaries; the confidence is split over them
GUESS_FRACTIONS = (0.05, 0.1, 0.2, 0.4, 1.0)


# ----------------------------------------------------------------------------------- the bound

def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P[at least v of r guesses correct] if training is (ε, δ)-DP for each of m canaries.

    Theorem 3 of the paper: with f(k) = P[Binomial(r, e^ε/(1+e^ε)) ≥ k], the probability is at
    most f(v) + 2mδ · max_{1≤i≤v} (f(v−i) − f(v)) / i.

    Args:
        m: canaries; r: guesses; v: correct guesses (ints, 0 ≤ v ≤ r ≤ m); epsilon: the ε tested, finite
            and ≥ 0; delta: the δ tested, in [0, 1) (0: pure ε-DP).
    Returns:
        that bound on the probability, in [0, 1].
    Raises:
        ValueError (TypeError for a value that is not a number) naming the argument that is out of range.
    """
    from scipy.stats import binom

    _check_counts(m, r, v)
    epsilon = check_in_range("epsilon", epsilon, low=0.0, low_open=False)
    delta = _check_test_delta(delta)
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = binom.sf(v - 1, r, q)  # f(v)
    worst = 0.0
    if delta > 0 and v > 0:
        between = np.cumsum(binom.pmf(v - np.arange(1, v + 1), r, q))  # f(v−i) − f(v), i = 1..v
        worst = float(np.max(between / np.arange(1, v + 1)))
    return float(min(1.0, tail + 2.0 * m * delta * worst))


def _check_counts(m, r, v) -> None:
    for name, value in (("m", m), ("r", r), ("v", v)):
        check_int(name, value, 0)
    if not v <= r <= m:
        raise ValueError(f"need 0 ≤ v ≤ r ≤ m, got m={m}, r={r}, v={v}")


def _check_test_delta(delta) -> float:
    # δ = 0 is pure ε-DP, a valid hypothesis here (unlike a δ a mechanism is calibrated to); a
    # negative δ would shrink Theorem 3's correction term and inflate the bound
    return check_in_range("delta", delta, low=0.0, high=1.0, low_open=False, high_open=True)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, significance: float = 0.05) -> float:
    """The audit's lower bound.

    Args:
        m: canaries; r: guesses; v: correct guesses (ints, 0 ≤ v ≤ r ≤ m); delta: δ in [0, 1);
            significance: of the test, in (0, 1) (at 1 every ε would be "rejected").
    Returns:
        the largest ε that v correct out of r reject at ``significance`` (0 if none).
    Raises:
        ValueError (TypeError for a value that is not a number) naming the argument that is out of range.
    """
    _check_counts(m, r, v)
    _check_test_delta(delta)
    significance = check_in_range("significance", significance, low=0.0, high=1.0, high_open=True)
    if r == 0 or p_value(m, r, v, 0.0, delta) > significance:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(m, r, v, high, delta) <= significance and high < 100:
        low, high = high, 2 * high
    for _ in range(60):
        mid = 0.5 * (low + high)
        if p_value(m, r, v, mid, delta) <= significance:
            low = mid
        else:
            high = mid
    return low


def guess_and_bound(scores: np.ndarray, included: np.ndarray, delta: float, confidence: float = 0.95,
                    fractions=GUESS_FRACTIONS) -> tuple[float, int, int]:
    """Guess which canaries were included and bound ε from the guesses.

    Args:
        scores: (m,) numbers, one per canary (higher: more likely included), m ≥ 2; included: (m,)
            bool, the truth; delta: δ in [0, 1); confidence: of the bound, in (0, 1); fractions: the
            k/m tried (Bonferroni over them), a non-empty sequence of numbers in (0, 1].
    Returns:
        (ε lower bound, correct, guesses) of the best k: "in" for the top k/2 scores, "out" for the
        bottom k/2.
    Raises:
        ValueError (TypeError for values of the wrong kind) naming the argument: scores and included
        of other shapes or lengths, fewer than 2 canaries (no guess either way), ``included`` not
        booleans (0/1 would be read as indices), a score that is NaN or infinite, or a number out of range.
    """
    scores = as_float_array("scores", scores)
    if not np.all(np.isfinite(scores)):   # a NaN ranks anywhere: the guesses, and the bound, would mean nothing
        raise ValueError(f"scores must be finite, got {int(np.sum(~np.isfinite(scores)))} NaN or infinite value(s)")
    included = np.asarray(included)
    if included.dtype.kind != "b":
        raise TypeError(f"included must be an array of booleans (True: the canary was included), "
                        f"got dtype {included.dtype}")
    if scores.ndim != 1 or included.shape != scores.shape:
        raise ValueError(f"scores and included must be 1-D with one entry per canary, got shapes "
                         f"{scores.shape} and {included.shape}")
    if len(scores) < 2:
        raise ValueError(f"scores must have at least 2 canaries (one guessed in, one out), got {len(scores)}")
    _check_test_delta(delta)
    confidence = check_in_range("confidence", confidence, low=0.0, high=1.0, high_open=True)
    if isinstance(fractions, (str, bytes)) or not hasattr(fractions, "__len__") or len(fractions) == 0:
        raise ValueError(f"fractions must be a non-empty sequence of numbers in (0, 1], got {fractions!r}")
    fractions = [check_in_range(f"fractions[{i}]", f, low=0.0, high=1.0) for i, f in enumerate(fractions)]
    m = len(scores)
    order = np.argsort(-scores, kind="stable")
    significance = (1.0 - confidence) / len(fractions)
    best = (0.0, 0, 0)
    for fraction in fractions:
        half = max(1, int(fraction * m) // 2)
        if 2 * half > m:
            half = m // 2
        if half == 0:
            continue
        correct = int(included[order[:half]].sum() + (~included[order[m - half:]]).sum())
        bound = epsilon_lower_bound(m, 2 * half, correct, delta, significance)
        if bound > best[0] or best[2] == 0:
            best = (bound, correct, 2 * half)
    return best


# ----------------------------------------------------------------------------------- the run

@dataclass
class AuditRow:
    """The audit of one privacy group under one method.

    Attributes:
        method: one of ``AUDITED_METHODS``.
        group_budget: the group's budget ε_g (None: all canaries, non-private).
        certified_epsilon: what the plan guarantees that group (≤ ε_g; dpsgd: the smallest budget;
            None for non-private).
        epsilon_lower_bound: the empirical lower bound on ε (≥ 0) at ``confidence``.
        canaries: the group's number of canaries.
        correct: correct guesses among ``guesses``.
        guesses: how many canaries were guessed (the best of the ``GUESS_FRACTIONS`` tried).
        confidence: of the bound, in (0, 1).
    """

    method: str
    group_budget: float | None
    certified_epsilon: float | None
    epsilon_lower_bound: float
    canaries: int
    correct: int
    guesses: int
    confidence: float


class _Scorer:
    """Accumulates, for every canary i, Σ_t ⟨W_t[:, i] − W_{t+1}[:, i], δ_i(θ_t)/‖δ_i(θ_t)‖⟩: how far
    each step moved canary i's own input column of the first layer along the direction its own
    gradient points (δ_i: the gradient of its loss at the first layer's output).

    Canaries are Dirac inputs (canary i is non-zero on its own column only), so the first layer's
    output for canary i is its value there times that column of W, plus the bias: O(m·hidden) a step
    where the dense (m, features + m) product was O(m²·hidden) (the audit's cost at 10^4 canaries).
    """

    def __init__(self, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, columns: torch.Tensor):
        self.values = x[torch.arange(len(x)), columns]
        if torch.count_nonzero(x) != torch.count_nonzero(self.values):   # a non-zero off its own column
            raise ValueError("canaries must be Dirac inputs: non-zero on their own column only")
        self.model, self.y, self.columns = model, y, columns
        self.scores = torch.zeros(len(x), dtype=torch.float64)
        self._snapshot()

    def _snapshot(self) -> None:
        first, rest = self.model[0], self.model[1:]
        was_training = self.model.training
        self.model.eval()  # DP layers compute their plain forward outside a private batch
        with torch.enable_grad():
            hidden = self.values[:, None] * first.weight.detach()[:, self.columns].t()
            if first.bias is not None:
                hidden = hidden + first.bias.detach()
            hidden.requires_grad_(True)
            loss = nn.functional.cross_entropy(rest(hidden), self.y, reduction="sum")
            (delta,) = torch.autograd.grad(loss, hidden)
        self.model.train(was_training)
        delta = delta.double()
        self.directions = delta / delta.norm(dim=1, keepdim=True).clamp_min(1e-12)  # (m, hidden)
        self.weights = first.weight.detach()[:, self.columns].double().t().clone()  # (m, hidden)

    def step(self) -> None:
        now = self.model[0].weight.detach()[:, self.columns].double().t()
        self.scores += ((self.weights - now) * self.directions).sum(1)
        self._snapshot()


def canaries(m: int, features: int, classes: int, groups: int, scale: float, seed: int):
    """Dirac input canaries for a model with ``features + m`` inputs: canary i is ``scale`` on input
    ``features + i`` and 0 elsewhere (every real record is 0 there), with a random label; spread
    evenly over the groups, each included with probability 1/2.

    Args:
        m: the number of canaries.
        features: the real records' number of inputs.
        classes: K, labels are drawn uniformly from 0..K−1.
        groups: the number of privacy groups (canary i is in group i mod ``groups``).
        scale: the canary's value on its own input.
        seed: of the labels and the inclusion coins.
    Returns:
        (x (m, features + m) float32, y (m,) int64 tensor, group (m,) int numpy array,
        included (m,) bool numpy array).
    Raises:
        ValueError naming the argument: counts below 1 (features below 0), a scale not finite and
        > 0 (a canary at 0 is no canary: the audit would "pass" on it), a negative seed.
    """
    for name, value, least in (("m", m, 1), ("features", features, 0), ("classes", classes, 1),
                               ("groups", groups, 1), ("seed", seed, 0)):
        check_int(name, value, least)
    scale = check_positive("scale", scale)
    rng = np.random.default_rng(seed)
    x = torch.zeros(m, features + m)
    x[torch.arange(m), features + torch.arange(m)] = scale
    y = torch.tensor(rng.integers(0, classes, m))
    group = np.arange(m) % groups
    included = rng.random(m) < 0.5
    return x, y, group, included


def audit_model(inputs: int, hidden: int = 128, classes: int = 10) -> nn.Sequential:
    """The demo's MLP, widened for the canaries.

    Args:
        inputs: features plus one per canary.
        hidden: width of the hidden (tanh) layer.
        classes: K, number of logits.
    Returns:
        ``nn.Sequential``: (B, inputs) float32 → (B, K) logits.
    """
    return nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, classes))


def _check_group_epsilons(values) -> tuple[float, ...]:
    """ε per privacy group: a non-empty sequence of finite numbers > 0 (not a string, not booleans)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"group_epsilons must be a sequence of budgets ε, one per privacy group, got "
                        f"{type(values).__name__} {values!r}")
    if len(values) == 0:
        raise ValueError("group_epsilons is empty; give one budget ε per privacy group")
    return tuple(check_positive(f"group_epsilons[{i}]", v) for i, v in enumerate(values))


def audit_method(method: str, data, budgets: np.ndarray, canary_set, *, group_epsilons, delta: float, epochs: int,
                 batch_size: int, lr: float, seed: int, broken: str | None = None, progress=None,
                 confidence: float = 0.95) -> list[AuditRow]:
    """One training run of ``method`` with the canaries.

    Args:
        method: one of AUDITED_METHODS.
        data: (x (N, d) float32, y (N,) int64), the real records.
        budgets: (N,) float64 their ε_i.
        canary_set: (features, labels, group, included), as :func:`canaries` returns.
        group_epsilons: ε per group.
        delta, epochs, batch_size, lr, seed: of the run (batch_size: expected records per step).
        broken: a deliberately broken variant ("no-noise", "no-clipping") or None.
        progress: a bar, updated once per step, or None.
        confidence: of the bounds, in (0, 1).
    Returns:
        one :class:`AuditRow` per privacy group (a single row for all canaries when non-private).
    Raises:
        ValueError for an unknown method or broken variant, or group_epsilons that are not budgets. A batch
        size above the records (data and canaries) is capped (q = 1) with a warning, as in ``pdpfast train``.
    """
    from .accounting import calibrate
    from .demo import capped_batch_size
    from .engine import PrivacyEngine
    from .loop import Task, private_steps

    if method not in AUDITED_METHODS:
        raise ValueError(f"method must be one of {', '.join(AUDITED_METHODS)}, got {method!r}")
    check_choice("broken", broken, BROKEN)
    group_epsilons = _check_group_epsilons(group_epsilons)
    x_tr, y_tr = data
    cx, cy, cgroup, included = canary_set
    x_tr = nn.functional.pad(x_tr, (0, cx.shape[1] - x_tr.shape[1]))  # real records: 0 on canary inputs
    x = torch.cat([x_tr, cx])
    y = torch.cat([y_tr, cy])
    canary_budgets = np.asarray(group_epsilons, dtype=np.float64)[cgroup]
    all_budgets = np.concatenate([budgets, canary_budgets])
    n = len(x)
    batch_size = capped_batch_size(batch_size, n)
    sample_rate = batch_size / n
    steps = epochs * round(1 / sample_rate)
    private = method != "non-private"
    plan_budgets = np.full(n, all_budgets.min()) if method == "dpsgd" else all_budgets
    plan = calibrate(plan_budgets, delta=delta, steps=steps, sample_rate=sample_rate,
                     method="sample" if method in ("dpsgd", "non-private") else method)
    rates = plan.sample_rates.copy() if private else np.full(n, sample_rate)
    rates[len(x_tr):][~included] = 0.0  # excluded canaries are never drawn
    clip_norms = plan.clip_norms if private and broken != "no-clipping" else np.full(n, 1e9)
    sigma = plan.noise_multiplier if private and broken != "no-noise" else 0.0

    torch.manual_seed(seed)
    model = audit_model(x.shape[1])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    engine = PrivacyEngine(seed=seed)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x, y), batch_size=batch_size),
        noise_multiplier=sigma, max_grad_norm=plan.max_grad_norm, sample_rates=rates, clip_norms=clip_norms,
        loss_reduction="sum", steps_per_epoch=round(1 / sample_rate))
    optimizer.expected_batch_size = plan.expected_batch_size  # fixed before the coin flips (module docstring)
    scorer = _Scorer(model, cx, cy, torch.arange(x.shape[1] - len(cx), x.shape[1]))
    def on_step(step, loss):
        scorer.step()
        if progress is not None:
            progress.update(1)

    task = Task()
    private_steps(engine, model, optimizer, loader, task, task.criterion(), until=steps, on_step=on_step)
    engine.detach()
    scores = scorer.scores.numpy()
    rows = []
    if not private:
        bound, correct, guesses = guess_and_bound(scores, included, delta, confidence)
        return [AuditRow(method, None, None, bound, len(scores), correct, guesses, confidence)]
    for g, epsilon in enumerate(group_epsilons):
        members = cgroup == g
        bound, correct, guesses = guess_and_bound(scores[members], included[members], delta, confidence)
        certified = float(all_budgets.min()) if method == "dpsgd" else float(epsilon)
        rows.append(AuditRow(method, float(epsilon), certified, bound, int(members.sum()), correct, guesses,
                             confidence))
    return rows


def run_audit(*, methods=AUDITED_METHODS, canaries_count: int = 3000, group_epsilons=(1.0, 2.0, 3.0),
              delta: float = 1e-5, epochs: int = 10, batch_size: int = 128, lr: float = 0.2, seed: int = 0,
              canary_scale: float = 10.0, broken: str | None = None, confidence: float = 0.95,
              quiet: bool = False, threads: int | None = None) -> dict:
    """The default audit: the demo's task (digits, groups at ε = 1/2/3, δ = 1e-5), every method.

    Args:
        methods: which of ``AUDITED_METHODS`` to run, one training run each (a non-empty sequence, each
            name once; all are checked before the first run).
        canaries_count: m, an int ≥ 2 per group.
        group_epsilons: ε per group, a non-empty sequence of finite numbers > 0; the real records get
            budgets drawn uniformly from them.
        delta: δ.
        epochs, batch_size, lr, seed: of every run (batch_size: expected records per step, capped at the
            records with a warning; seed: an int in [0, 2**32 − 1], as scikit-learn's split takes).
        canary_scale: a canary's value on its own input, finite and > 0.
        broken: a deliberately broken variant ("no-noise", "no-clipping") or None.
        confidence: of the bounds, in (0, 1).
        quiet: no progress bars.
        threads: torch threads for the runs; None or 0 (the default) leaves torch's setting, which was
            the fastest on an idle 2-core machine (19 s against 25 s with 1), while on a loaded one
            1 thread was over 10× faster than torch's 2.
    Returns:
        {"delta", "confidence", "broken", "seconds" (wall time of the runs), "rows": [AuditRow as dict, ...]}.
    Raises:
        ValueError (TypeError for a value of the wrong kind) before any training: an unknown, repeated or no
        method, group_epsilons that are not budgets, too few canaries, a confidence outside (0, 1), a seed
        outside [0, 2**32 − 1], epochs or batch_size below 1, lr or canary_scale not finite and > 0, δ
        outside (0, 1), an unknown broken variant.
    """
    from tqdm.auto import tqdm

    from .demo import capped_batch_size, check_method_names, load_digits_split, torch_threads

    methods = check_method_names("methods", methods, AUDITED_METHODS)
    group_epsilons = _check_group_epsilons(group_epsilons)
    if check_int("canaries_count", canaries_count, 0) < 2 * len(group_epsilons):
        raise ValueError(f"canaries_count must be an int ≥ 2 per group, got {canaries_count!r}")
    confidence = check_in_range("confidence", confidence, low=0.0, high=1.0, high_open=True)
    check_int("seed", seed, 0, maximum=2 ** 32 - 1)    # scikit-learn's random_state takes no more
    check_int("epochs", epochs, 1)
    check_int("batch_size", batch_size, 1)
    check_positive("lr", lr)
    check_positive("canary_scale", canary_scale)
    check_delta("delta", delta)
    check_choice("broken", broken, BROKEN)
    if threads is not None:
        check_int("threads", threads, 0)
    x_tr, y_tr, _, _ = load_digits_split(seed)
    batch_size = capped_batch_size(batch_size, len(x_tr) + canaries_count)
    rng = np.random.default_rng(seed)
    budgets = rng.choice(np.asarray(group_epsilons, dtype=np.float64), size=len(x_tr))
    canary_set = canaries(canaries_count, x_tr.shape[1], 10, len(group_epsilons), canary_scale, seed + 1)
    start, rows = time.perf_counter(), []
    for method in methods:
        n = len(x_tr) + canaries_count
        steps = epochs * round(n / batch_size)
        with tqdm(total=steps, desc=f"audit {method}", disable=quiet, leave=False) as bar, torch_threads(threads):
            rows += audit_method(method, (x_tr, y_tr), budgets, canary_set, group_epsilons=group_epsilons,
                                 delta=delta, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, broken=broken,
                                 progress=bar, confidence=confidence)
    return {"delta": delta, "confidence": confidence, "broken": broken, "seconds": time.perf_counter() - start,
            "rows": [asdict(r) for r in rows]}


def _check_result(result, keys=("rows", "delta", "confidence")) -> None:
    missing = [k for k in keys if not isinstance(result, dict) or k not in result]
    if missing:
        raise ValueError(f"result must be what run_audit returns; it has no {', '.join(map(repr, missing))}")


def format_table(result: dict) -> str:
    """The audit as a table.

    Args:
        result: from :func:`run_audit`.
    Returns:
        a Markdown table, one row per method and group, with a line on δ and the confidence.
    Raises:
        ValueError naming ``result`` if it lacks the keys :func:`run_audit` returns.
    """
    _check_result(result)
    lines = ["| method | group budget ε | certified ε | ε lower bound | correct / guesses | canaries |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        budget = "–" if r["group_budget"] is None else f"{r['group_budget']:g}"
        certified = "–" if r["certified_epsilon"] is None else f"{r['certified_epsilon']:g}"
        lines.append(f"| {r['method']} | {budget} | {certified} | {r['epsilon_lower_bound']:.3f} | "
                     f"{r['correct']} / {r['guesses']} | {r['canaries']} |")
    lines.append(f"δ = {result['delta']:g}, confidence {result['confidence']:.0%} (Steinke, Nasr & Jagielski 2023)")
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    """Plot the audit.

    Args:
        result: from :func:`run_audit`.
        path: the image (written atomically, in the format its suffix names): lower bound against budget
            per group, one series per method, with the line bound = budget.
    Returns:
        None.
    Raises:
        ValueError naming ``result`` if it lacks the keys :func:`run_audit` returns, or naming ``path``
        as :func:`pdpfast.plots.check_image_path` does.
    """
    from .plots import check_image_path, figure, save_figure

    _check_result(result, ("rows", "confidence"))
    image_format = check_image_path(path)
    with figure(figsize=(6, 4)) as (fig, ax):
        rows = result["rows"]
        budgets = sorted({r["group_budget"] for r in rows if r["group_budget"] is not None})
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = [r for r in rows if r["method"] == method and r["group_budget"] is not None]
            if mine:
                ax.plot([r["group_budget"] for r in mine], [r["epsilon_lower_bound"] for r in mine], "o-", label=method)
            else:
                bound = [r["epsilon_lower_bound"] for r in rows if r["method"] == method][0]
                ax.axhline(bound, ls=":", color="grey", label=f"{method} ({bound:.2f})")
        if budgets:
            ax.plot(budgets, budgets, "k--", lw=1, label="lower bound = budget")
        ax.set_xlabel("group budget ε")
        ax.set_ylabel(f"empirical ε lower bound ({result['confidence']:.0%})")
        ax.set_title("One-run privacy audit per privacy group")
        ax.legend(fontsize=8)
        save_figure(fig, path, image_format)
