"""Binary-score statistics over plain numpy arrays: the logistic fit, log-loss, calibration error, AUC and its
standard error, and Wilson's lower bound of a proportion (the calibration, the fine-tune's metrics and the demo's
measurements share them)."""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike, NDArray

ECE_BINS = 10
_EPS = 1e-7  # probabilities clipped to [EPS, 1 − EPS]: a confident model's exact 0 or 1 stays finite
FloatArray = NDArray[np.float64]


def fit_logistic(scores: ArrayLike, labels: ArrayLike, *, ridge: float = 1e-3, steps: int = 50
                 ) -> tuple[float, float]:
    """Slope and intercept of P(label | score) = sigmoid(slope · score + intercept), by Newton's method
    (a small ridge keeps it finite when the classes separate)."""
    s = np.asarray(scores, dtype=np.float64)
    x = np.stack([s, np.ones(len(s))], axis=1)
    y = np.asarray(labels, dtype=np.float64)
    w = np.zeros(2)
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        grad = x.T @ (p - y) + ridge * w
        hess = (x * (p * (1 - p))[:, None]).T @ x + ridge * np.eye(2)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-9:
            break
    return float(w[0]), float(w[1])


def sigmoid(x: ArrayLike) -> FloatArray:
    z = np.asarray(x, dtype=np.float64)
    return np.exp(-np.logaddexp(0.0, -z))


def logit(p: ArrayLike) -> FloatArray:
    q = np.clip(np.asarray(p, dtype=np.float64), _EPS, 1 - _EPS)
    return np.log(q / (1 - q))


def log_loss(p: ArrayLike, labels: ArrayLike) -> float:
    q = np.clip(np.asarray(p, dtype=np.float64), _EPS, 1 - _EPS)
    y = np.asarray(labels, dtype=np.float64)
    return float(-np.mean(y * np.log(q) + (1 - y) * np.log(1 - q)))


def ece(p: ArrayLike, labels: ArrayLike, bins: int = ECE_BINS) -> float:
    """Expected calibration error: the share-weighted gap between mean probability and the share of yes, over
    ``bins`` equal-width bins of the probability."""
    q = np.asarray(p, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    which = np.minimum((q * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        inside = which == b
        if inside.any():
            total += inside.mean() * abs(q[inside].mean() - y[inside].mean())
    return float(total)


def auc(scores: ArrayLike, labels: ArrayLike) -> float:
    """Probability that a yes outscores a no (ties count half); NaN with one answer only."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    ranks = (ends - (counts - 1) / 2.0)[inverse]  # average 1-based rank of each tie group
    return float((ranks[y].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def auc_standard_error(value: float, positives: int, negatives: int) -> float:
    """Hanley & McNeil's standard error of an AUC."""
    a = min(max(value, 1e-6), 1 - 1e-6)
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    var = (a * (1 - a) + (positives - 1) * (q1 - a * a) + (negatives - 1) * (q2 - a * a)) / (positives * negatives)
    return math.sqrt(max(var, 0.0))


def lower_bound(successes: ArrayLike, n: ArrayLike, z: float) -> FloatArray:
    """Wilson's lower confidence bound of a proportion (``z`` standard errors; 0: the proportion itself)."""
    k, m = np.asarray(successes, dtype=np.float64), np.asarray(n, dtype=np.float64)
    p = k / m
    centre = p + z * z / (2 * m)
    spread = z * np.sqrt(p * (1 - p) / m + z * z / (4 * m * m))
    return np.asarray((centre - spread) / (1 + z * z / m), dtype=np.float64)
