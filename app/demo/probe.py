"""What a checkpoint's vision tower shows: a linear probe per attribute on its packages.

Neither demo model can learn an attribute its tower does not show (the reranker keeps the embedder's tower
frozen), so the probe is the ceiling under what training the language model can reach. Features are a
package's tokens mean- and max-pooled (what the tower pre-training's head reads), standardised; a multinomial
logistic regression per attribute is fitted on freshly drawn training-split faces (new nuisance, seed
:data:`PROBE_SEED`) and scored on the held-out ``eval`` and ``tune`` faces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from rubricsearch.app.demo.faces import ATTRIBUTES, VALUES, Face, Split
from rubricsearch.app.demo.training import ImageBank, Trainee, pooled_tokens

PROBE_SEED = 11  # the training faces' draws use TRAIN_SEED: these images are new to the tower
HELD_OUT_SEED = 0


def _features(trainee: Trainee, split: Split, count: int, seed: int, chunk: int = 60
              ) -> tuple[torch.Tensor, list[Face]]:
    bank = ImageBank.build(trainee.encoder, split, count, seed=seed)
    rows: list[torch.Tensor] = []
    with torch.no_grad():
        for start in range(0, count, chunk):
            part = range(start, min(count, start + chunk))
            pk = trainee.packages(bank, part)
            rows += [pooled_tokens(pk[i].embeds) for i in part]
    return torch.stack(rows), bank.faces


def tower_probe(checkpoint: Path, *, fit: int = 480, held_out: int = 120, l2: float = 1e-2,
                threads: int | None = None) -> dict[str, float]:
    """Held-out accuracy per attribute of a linear probe on the tower's pooled packages."""
    trainee = Trainee(checkpoint, threads=threads)
    trainee.full.eval()
    x_fit, f_fit = _features(trainee, "train", fit, PROBE_SEED)
    parts = [_features(trainee, split, held_out, HELD_OUT_SEED) for split in ("eval", "tune")]
    x_test = torch.cat([x for x, _ in parts])
    f_test = [f for _, fs in parts for f in fs]
    labels = {a: (VALUES[a], [f.value(a) for f in f_fit], [f.value(a) for f in f_test]) for a in ATTRIBUTES}
    return probe_accuracy(x_fit, x_test, labels, l2)


def probe_accuracy(x_fit: torch.Tensor, x_test: torch.Tensor,
                   labels: Mapping[str, tuple[Sequence[str], Sequence[str], Sequence[str]]], l2: float
                   ) -> dict[str, float]:
    """Per attribute (its values, the fitted rows' and the held-out rows' values): the held-out accuracy of a
    multinomial logistic regression on the standardised features."""
    mean, std = x_fit.mean(0), x_fit.std(0) + 1e-6
    x_fit, x_test = (x_fit - mean) / std, (x_test - mean) / std
    out: dict[str, float] = {}
    for a, (values, fitted, tested) in labels.items():
        y_fit = torch.tensor([list(values).index(v) for v in fitted])
        y_test = torch.tensor([list(values).index(v) for v in tested])
        torch.manual_seed(0)
        linear = torch.nn.Linear(x_fit.shape[1], len(values))
        opt = torch.optim.LBFGS(linear.parameters(), max_iter=200)

        def closure(linear: torch.nn.Linear = linear, opt: torch.optim.LBFGS = opt,
                    y: torch.Tensor = y_fit) -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(linear(x_fit), y) + l2 * linear.weight.pow(2).sum()
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            out[a] = float((linear(x_test).argmax(1) == y_test).float().mean())
    return out
