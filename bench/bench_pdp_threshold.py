"""PDP-SGD's threshold rule on the demo's task: which first-round τ each loss picks, and the test
accuracy it buys (digits, δ = 1e-5, 2 rounds, 10 epochs), over seeds, for the demo's budgets
(ε = 1/2/3 for 34/43/23%) and for five groups (ε = 0.5/1/2/4/8 for 30/30/20/10/10%).

    python -m bench.bench_pdp_threshold [--seeds 3]

Writes bench/results/pdp_threshold_cpu.json.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from bench.harness import environment, write_rows

LOSSES = ("fixed", "adaptive", "harmonic")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default="bench/results/pdp_threshold_cpu.json")
    args = parser.parse_args(argv)
    from pdpfast.accounting import pdp
    from pdpfast.demo import assign_budgets, load_digits_split, train_private

    torch.set_num_threads(1)
    def five_groups(n, seed):
        return np.random.default_rng(seed).choice([0.5, 1.0, 2.0, 4.0, 8.0], n, p=[0.3, 0.3, 0.2, 0.1, 0.1])

    rows = []
    for budget_set, make_budgets in (("demo 1/2/3", assign_budgets), ("five groups 0.5-8", five_groups)):
        for loss in LOSSES:
            accuracies, threshold = [], None
            for seed in range(args.seeds):
                data = load_digits_split(seed)
                budgets = make_budgets(len(data[0]), seed)
                threshold = pdp.select_threshold(budgets, loss=loss)
                result = train_private(data, budgets, method="pdp", epochs=args.epochs, batch_size=128, lr=0.2,
                                       seed=seed, pdp_loss=loss)
                accuracies.append(result.accuracy)
            rows.append({"benchmark": "pdp_threshold", "budgets": budget_set, "loss": loss,
                         "first_round_threshold": threshold, "accuracy_mean": float(np.mean(accuracies)),
                         "accuracy_std": float(np.std(accuracies)), "accuracies": accuracies, "seeds": args.seeds,
                         "epochs": args.epochs, **environment(torch.device("cpu"))})
    write_rows(args.out, rows)
    print("| budgets | loss | first-round τ | test accuracy |\n|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['budgets']} | {r['loss']} | {r['first_round_threshold']:.3f} | "
              f"{r['accuracy_mean']:.3f} ± {r['accuracy_std']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
