"""Probes of learned representations: kNN and linear classifiers on frozen features, and two
collapse diagnostics.

The probe metrics read an objective's evaluation outputs `features` [B, D] (one pooled vector per
example) and `label` [B] (int class ids), gather them over the validation pass, and split the
pass into examples the probe learns from and examples it is scored on. `effective_rank` and
`feature_std` work on NumPy or JAX arrays, inside jit too, so objectives log them while training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from dew.checks import count, count_fields


def effective_rank(features: Any, *, center: bool = True, eps: float = 1e-7) -> Any:
    """exp(entropy) of the normalized singular values of features [N, D] (RankMe, Garrido et al.
    2023, arXiv:2210.02885). Between 1 (one direction) and min(N, D) (a flat spectrum).

    With `center` (the default) the mean row is subtracted first, so the score measures how the
    examples spread rather than the shared mean direction (which dominates pooled features); a
    collapsed encoder (every row the same vector) scores about 1 either way. center=False is RankMe.
    """
    x = jnp.asarray(features, jnp.float32)
    if center:
        x = x - jnp.mean(x, axis=0, keepdims=True)
    singular = jnp.linalg.svd(x, compute_uv=False)
    p = singular / (jnp.sum(singular) + eps) + eps
    return jnp.exp(-jnp.sum(p * jnp.log(p)))


def feature_std(features: Any) -> Any:
    """The mean over dimensions of each dimension's standard deviation over the rows of [N, D].

    Falls to 0 when the representation collapses to one vector.
    """
    x = jnp.asarray(features, jnp.float32)
    return jnp.mean(jnp.std(x, axis=0))


def knn_predict(
    memory: np.ndarray,
    memory_labels: np.ndarray,
    queries: np.ndarray,
    num_classes: int,
    *,
    k: int = 20,
    temperature: float = 0.07,
    exclude_self: bool = False,
) -> np.ndarray:
    """Class predictions for `queries` by a weighted vote of their k most cosine-similar `memory`
    rows, each vote weighted by exp(similarity / temperature) (the kNN of Wu et al. 2018 and DINO).

    `exclude_self` drops the diagonal (queries are the memory: leave-one-out).
    """
    memory = _unit_rows(memory)
    queries = _unit_rows(queries)
    similarity = queries @ memory.T
    if exclude_self:
        np.fill_diagonal(similarity, -np.inf)
    k = max(1, min(k, memory.shape[0] - int(exclude_self)))
    nearest = np.argpartition(-similarity, k - 1, axis=1)[:, :k]
    weights = np.exp(np.take_along_axis(similarity, nearest, axis=1) / temperature)
    votes = np.zeros((queries.shape[0], num_classes))
    np.add.at(votes, (np.arange(queries.shape[0])[:, None], memory_labels[nearest]), weights)
    return votes.argmax(axis=1)


def knn_accuracy(
    memory, memory_labels, queries, query_labels, num_classes: int, *, k: int = 20, temperature: float = 0.07
) -> float:
    """The share of `queries` whose kNN vote over `memory` matches `query_labels`."""
    predicted = knn_predict(
        np.asarray(memory), np.asarray(memory_labels), np.asarray(queries), num_classes, k=k, temperature=temperature
    )
    return float(np.mean(predicted == np.asarray(query_labels)))


def linear_probe_accuracy(train, train_labels, test, test_labels, *, C: float = 1.0, max_iter: int = 2000) -> float:
    """Held-out accuracy of multinomial logistic regression on standardized frozen features."""
    try:
        from sklearn.linear_model import LogisticRegression
        from sklearn.preprocessing import StandardScaler
    except ImportError as error:  # pragma: no cover - sklearn ships with dew[test]
        raise ImportError(
            "LinearProbe needs scikit-learn: pip install scikit-learn (or dew[test])."
        ) from error
    train, test = np.asarray(train, np.float64), np.asarray(test, np.float64)
    scaler = StandardScaler().fit(train)
    model = LogisticRegression(C=C, max_iter=max_iter)
    model.fit(scaler.transform(train), np.asarray(train_labels))
    return float(model.score(scaler.transform(test), np.asarray(test_labels)))


def labels_per_class(labels: np.ndarray, per_class: int, seed: int = 0) -> np.ndarray:
    """Indices of `per_class` examples of each class (fewer where a class has fewer), sorted."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    chosen = [
        rng.permutation(np.flatnonzero(labels == c))[:per_class] for c in np.unique(labels)
    ]
    return np.sort(np.concatenate(chosen))


def _unit_rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _gather(accumulator, outputs: Mapping[str, np.ndarray], who: str):
    for key in ("features", "label"):
        if key not in outputs:
            raise ValueError(
                f"{who} reads the evaluation outputs 'features' [B, D] and 'label' [B], but the "
                f"objective's evaluate returned {sorted(k for k in outputs if not k.startswith('_'))}. "
                "Give the validation batches a 'label' field (JepaObjective passes it through)."
            )
    features = np.asarray(outputs["features"], np.float32)
    labels = np.asarray(outputs["label"]).reshape(-1)
    if features.ndim != 2 or features.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{who} expects features [B, D] and label [B]; got {features.shape} and {labels.shape}."
        )
    rows, row_labels = accumulator
    return rows + (features,), row_labels + (labels.astype(np.int64),)


def _stack(accumulator, num_classes: int, who: str) -> tuple[np.ndarray, np.ndarray]:
    rows, labels = accumulator
    if not rows:
        raise ValueError(f"{who} saw no validation batches.")
    features, labels = np.concatenate(rows), np.concatenate(labels)
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(
            f"{who} was built for {num_classes} classes, but the labels span "
            f"[{labels.min()}, {labels.max()}]. Pass the dataset's number of classes."
        )
    return features, labels


@dataclasses.dataclass(frozen=True)
class KnnProbe:
    """Cosine kNN accuracy on the validation pass's features (a `Metric`).

    split="half" (default): the even-numbered examples of the pass are the memory (the labeled
    set) and the odd-numbered ones the queries, so the score is on examples the memory never
    holds. split="leave_one_out": every example is a query against all the others. Votes are
    weighted by exp(cosine / temperature); k is capped at the memory size.
    """

    num_classes: int
    k: int = 20
    temperature: float = 0.07
    split: str = "half"
    name: str = "knn_accuracy"

    def __post_init__(self):
        count_fields(self, num_classes=2, k=1)
        if self.split not in ("half", "leave_one_out"):
            raise ValueError(f"KnnProbe split must be 'half' or 'leave_one_out'; got {self.split!r}.")

    def empty(self):
        return (), ()

    def update(self, accumulator, outputs):
        return _gather(accumulator, outputs, "KnnProbe")

    def result(self, accumulator):
        features, labels = _stack(accumulator, self.num_classes, "KnnProbe")
        if len(labels) < 2:
            raise ValueError("KnnProbe needs at least 2 validation examples.")
        settings = dict(k=self.k, temperature=self.temperature)
        if self.split == "leave_one_out":
            predicted = knn_predict(features, labels, features, self.num_classes, exclude_self=True, **settings)
            return {self.name: float(np.mean(predicted == labels))}
        memory, queries = slice(0, None, 2), slice(1, None, 2)
        accuracy = knn_accuracy(
            features[memory], labels[memory], features[queries], labels[queries], self.num_classes, **settings
        )
        return {self.name: accuracy}


@dataclasses.dataclass(frozen=True)
class LinearProbe:
    """Held-out accuracy of logistic regression on frozen features (a `Metric`; scikit-learn).

    A seeded permutation of the pass puts `fit_fraction` of the examples in the fit set and the rest
    in the scored set. `labels_per_class` keeps only that many fit examples per class (a low-label
    probe).
    """

    num_classes: int
    fit_fraction: float = 0.5
    labels_per_class: int | None = None
    C: float = 1.0
    max_iter: int = 2000
    seed: int = 0
    name: str = "linear_accuracy"

    def __post_init__(self):
        count_fields(self, num_classes=2, max_iter=1, seed=0)
        if not 0.0 < self.fit_fraction < 1.0:
            raise ValueError(f"LinearProbe fit_fraction must be in (0, 1); got {self.fit_fraction!r}.")
        labels_per_class = count(self.labels_per_class, "LinearProbe.labels_per_class", optional=True)
        object.__setattr__(self, "labels_per_class", labels_per_class)

    def empty(self):
        return (), ()

    def update(self, accumulator, outputs):
        return _gather(accumulator, outputs, "LinearProbe")

    def result(self, accumulator):
        features, labels = _stack(accumulator, self.num_classes, "LinearProbe")
        order = np.random.default_rng(self.seed).permutation(len(labels))
        cut = int(round(self.fit_fraction * len(labels)))
        fit, scored = order[:cut], order[cut:]
        if self.labels_per_class is not None:
            fit = fit[labels_per_class(labels[fit], self.labels_per_class, self.seed)]
        if len(scored) == 0 or len(np.unique(labels[fit])) < 2:
            raise ValueError(
                f"LinearProbe needs at least two classes to fit and one example to score; the pass "
                f"has {len(labels)} examples. Evaluate on more validation batches."
            )
        accuracy = linear_probe_accuracy(
            features[fit], labels[fit], features[scored], labels[scored], C=self.C, max_iter=self.max_iter
        )
        return {self.name: accuracy}
