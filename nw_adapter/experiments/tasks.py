"""Task families for in-context flow matching (THEORY.md section 5).

A *task* is a distribution q; the model sees a support set S = {s_1..s_m} drawn from q and
must generate new points of q. A :class:`TaskBatch` holds B tasks at once: the support
points (padded to a common size, with a boolean mask when sizes differ) and target points
drawn from the same distributions, independent of the support.

Families:

- :class:`GaussianMixtureFamily`: 2-8 anisotropic components in any d, means ~ 5 N(0, I).
- :class:`ShellFamily`: 2-5 concentric spherical shells, radii around 5, radial noise 0.3.
- :class:`Mixed2DFamily`: the 2-D mixed family (mixtures, rings, moons, spirals).
- :class:`FeatureTaskFamily`: one class of a feature matrix = one task (real features).

Train / validation / test tasks of the synthetic families are split by seed
(:func:`split_generator`); those of feature families by class (:func:`make_feature_splits`).
"""

from __future__ import annotations

import math
import zipfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "TaskBatch",
    "TaskFamily",
    "GaussianMixtureFamily",
    "ShellFamily",
    "Mixed2DFamily",
    "FeatureTaskFamily",
    "FeatureSplits",
    "split_generator",
    "support_size_range",
    "load_digits_features",
    "load_feature_file",
    "make_feature_splits",
    "class_folds",
]

_SPLIT_OFFSETS = {"train": 0, "val": 1, "test": 2}


@dataclass
class TaskBatch:
    """A batch of B tasks.

    Attributes:
        support: Support points, float32 ``[B, m, d]``; padded rows (mask False) are zero.
        target: Held-out points of the same tasks, float32 ``[B, n, d]``.
        support_mask: Bool ``[B, m]``, True = valid support point, or None when all are valid.
    """

    support: Tensor
    target: Tensor
    support_mask: Tensor | None = None

    @property
    def num_tasks(self) -> int:
        return self.support.shape[0]

    @property
    def dim(self) -> int:
        return self.support.shape[-1]

    def support_sizes(self) -> Tensor:
        """Number of valid support points per task, int64 ``[B]``."""
        if self.support_mask is None:
            return torch.full((self.num_tasks,), self.support.shape[1], dtype=torch.long)
        return self.support_mask.sum(-1)

    def task(self, index: int) -> TaskBatch:
        """The single task ``index`` as a batch of one, with padding removed."""
        m = int(self.support_sizes()[index])
        return TaskBatch(self.support[index : index + 1, :m], self.target[index : index + 1], None)


def split_generator(seed: int, split: str) -> torch.Generator:
    """Generator for the tasks of one split of a synthetic family (split by seed).

    Args:
        seed: Base seed of the experiment.
        split: ``"train"``, ``"val"`` or ``"test"``; each gets a disjoint seed stream.

    Returns:
        A CPU generator seeded with ``1_000_003 * seed + 7919 * offset(split) + 17``.
    """
    if split not in _SPLIT_OFFSETS:
        raise ValueError(f"split={split!r} is not one of {sorted(_SPLIT_OFFSETS)}; pass train, val or test.")
    return torch.Generator().manual_seed(1_000_003 * int(seed) + 7919 * _SPLIT_OFFSETS[split] + 17)


def support_size_range(num_support: int | tuple[int, int]) -> tuple[int, int]:
    """Normalise a support size (int m, or an inclusive range (lo, hi)) to ``(lo, hi)``."""
    if isinstance(num_support, int):
        lo = hi = num_support
    else:
        lo, hi = (int(v) for v in num_support)
    if lo < 1 or hi < lo:
        raise ValueError(
            f"num_support={num_support!r} is invalid; pass an int >= 1 or a range (lo, hi), 1 <= lo <= hi."
        )
    return lo, hi


def _ragged_mask(num_tasks: int, num_support, generator: torch.Generator) -> tuple[int, Tensor | None]:
    """Draw per-task support sizes uniformly in [lo, hi]; returns (m_max, mask[B, m_max] or None)."""
    lo, hi = support_size_range(num_support)
    if lo == hi:
        return hi, None
    sizes = torch.randint(lo, hi + 1, (num_tasks,), generator=generator)
    mask = torch.arange(hi)[None, :] < sizes[:, None]
    return hi, mask


def _split_points(points: Tensor, m: int, mask: Tensor | None) -> TaskBatch:
    """Split iid points ``[B, m + n, d]`` into support (first m, padding zeroed) and target."""
    support = points[:, :m].clone()
    if mask is not None:
        support = support * mask[..., None]
    return TaskBatch(support, points[:, m:].contiguous(), mask)


def _random_rotations(shape: tuple[int, ...], d: int, generator: torch.Generator) -> Tensor:
    """Haar-random orthogonal matrices ``[*shape, d, d]`` by QR with sign correction."""
    a = torch.randn(*shape, d, d, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    sign = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    return (q * sign[..., None, :]).float()


class TaskFamily(ABC):
    """A distribution over tasks; ``sample`` draws a :class:`TaskBatch`."""

    dim: int

    @abstractmethod
    def sample(
        self,
        num_tasks: int,
        num_support: int | tuple[int, int],
        num_target: int,
        *,
        generator: torch.Generator,
    ) -> TaskBatch:
        """Draw ``num_tasks`` tasks.

        Args:
            num_tasks: B.
            num_support: m, or an inclusive range (lo, hi): each task then gets m_b ~ U{lo..hi}
                valid points, padded to hi and masked.
            num_target: n held-out points per task.
            generator: Source of randomness (the only one; results are a function of it).

        Returns:
            The batch.
        """

    def _check(self, num_tasks: int, num_target: int) -> None:
        if num_tasks < 1:
            raise ValueError(f"num_tasks={num_tasks} must be >= 1.")
        if num_target < 1:
            raise ValueError(f"num_target={num_target} must be >= 1.")


class GaussianMixtureFamily(TaskFamily):
    """Anisotropic Gaussian mixtures in R^d.

    Each task: K ~ U{k_min..k_max} equally weighted components, means mu_k ~ mean_scale N(0, I),
    covariance Sigma_k = Q_k diag(s_k)^2 Q_k^T with Q_k Haar-random and axis standard deviations
    s_kj = base_k * r_k^(j/(d-1) - 1/2) (geometric from base/sqrt(r) to base*sqrt(r)),
    base_k ~ U(std_range), aspect ratio r_k ~ U(aspect_range) (so max/min std = r_k).

    Args:
        dim: d >= 1.
        components: Inclusive range of K.
        mean_scale: Scale of the means (5 in the paper).
        std_range: Range of the geometric-mean component standard deviation.
        aspect_range: Range of the ratio of largest to smallest axis standard deviation.
    """

    def __init__(
        self,
        dim: int,
        *,
        components: tuple[int, int] = (2, 8),
        mean_scale: float = 5.0,
        std_range: tuple[float, float] = (0.3, 0.8),
        aspect_range: tuple[float, float] = (3.0, 10.0),
    ) -> None:
        if dim < 1:
            raise ValueError(f"dim={dim} must be >= 1.")
        if components[0] < 1 or components[1] < components[0]:
            raise ValueError(f"components={components} must be a range (lo, hi) with 1 <= lo <= hi.")
        self.dim = dim
        self.components = components
        self.mean_scale = mean_scale
        self.std_range = std_range
        self.aspect_range = aspect_range

    def sample_parameters(self, num_tasks: int, generator: torch.Generator) -> dict[str, Tensor]:
        """Draw mixture parameters for ``num_tasks`` tasks (padded to k_max components).

        Returns:
            ``num_components`` [B], ``means`` [B, K, d], ``rotations`` [B, K, d, d],
            ``stds`` [B, K, d] (axis standard deviations before rotation).
        """
        b, d = num_tasks, self.dim
        k_lo, k_hi = self.components
        num_components = torch.randint(k_lo, k_hi + 1, (b,), generator=generator)
        means = self.mean_scale * torch.randn(b, k_hi, d, generator=generator)
        rotations = _random_rotations((b, k_hi), d, generator)
        base = torch.empty(b, k_hi, 1).uniform_(*self.std_range, generator=generator)
        aspect = torch.empty(b, k_hi, 1).uniform_(*self.aspect_range, generator=generator)
        expo = torch.linspace(-0.5, 0.5, d) if d > 1 else torch.zeros(1)
        stds = base * aspect**expo
        return {"num_components": num_components, "means": means, "rotations": rotations, "stds": stds}

    def sample_points(self, params: dict[str, Tensor], num_points: int, generator: torch.Generator) -> Tensor:
        """Draw ``num_points`` iid points per task from given parameters, ``[B, N, d]``."""
        k = params["num_components"]
        b = k.shape[0]
        u = torch.rand(b, num_points, generator=generator)
        comp = torch.clamp((u * k[:, None]).long(), max=params["means"].shape[1] - 1)  # [B, N]
        eps = torch.randn(b, num_points, self.dim, generator=generator)
        gather = comp[..., None].expand(-1, -1, self.dim)
        mu = torch.gather(params["means"], 1, gather)
        std = torch.gather(params["stds"], 1, gather)
        rot = params["rotations"][torch.arange(b)[:, None], comp]  # [B, N, d, d]
        return mu + torch.einsum("bnij,bnj->bni", rot, std * eps)

    def sample(self, num_tasks, num_support, num_target, *, generator):
        self._check(num_tasks, num_target)
        m, mask = _ragged_mask(num_tasks, num_support, generator)
        params = self.sample_parameters(num_tasks, generator)
        return _split_points(self.sample_points(params, m + num_target, generator), m, mask)


class ShellFamily(TaskFamily):
    """Concentric spherical shells in R^d.

    Each task: K ~ U{k_min..k_max} equally weighted shells with radii stratified in
    ``radius_range`` (r_k = lo + (hi - lo)(k + U(0.2, 0.8)) / K, so the mean radius is the
    midpoint, 5 by default), centre c ~ center_scale N(0, I). A point is
    c + (r_k + radial_noise * eps) u with u uniform on the unit sphere and eps ~ N(0, 1).

    Args:
        dim: d >= 2.
        shells: Inclusive range of K.
        radius_range: Range the radii are stratified over.
        radial_noise: Standard deviation of the radial noise (0.3 in the paper).
        center_scale: Scale of the random centre (0 = centred at the origin).
    """

    def __init__(
        self,
        dim: int,
        *,
        shells: tuple[int, int] = (2, 5),
        radius_range: tuple[float, float] = (2.0, 8.0),
        radial_noise: float = 0.3,
        center_scale: float = 0.0,
    ) -> None:
        if dim < 2:
            raise ValueError(f"dim={dim} must be >= 2 for spherical shells.")
        if shells[0] < 1 or shells[1] < shells[0]:
            raise ValueError(f"shells={shells} must be a range (lo, hi) with 1 <= lo <= hi.")
        self.dim = dim
        self.shells = shells
        self.radius_range = radius_range
        self.radial_noise = radial_noise
        self.center_scale = center_scale

    def sample_parameters(self, num_tasks: int, generator: torch.Generator) -> dict[str, Tensor]:
        """Returns ``num_shells`` [B], ``radii`` [B, K_max] (sorted), ``centers`` [B, d]."""
        k_lo, k_hi = self.shells
        num_shells = torch.randint(k_lo, k_hi + 1, (num_tasks,), generator=generator)
        jitter = torch.empty(num_tasks, k_hi).uniform_(0.2, 0.8, generator=generator)
        lo, hi = self.radius_range
        radii = lo + (hi - lo) * (torch.arange(k_hi)[None, :] + jitter) / num_shells[:, None]
        centers = self.center_scale * torch.randn(num_tasks, self.dim, generator=generator)
        return {"num_shells": num_shells, "radii": radii, "centers": centers}

    def sample_points(self, params: dict[str, Tensor], num_points: int, generator: torch.Generator) -> Tensor:
        """Draw ``num_points`` iid points per task, ``[B, N, d]``."""
        k = params["num_shells"]
        b = k.shape[0]
        comp = (torch.rand(b, num_points, generator=generator) * k[:, None]).long()  # floor(u K) < K
        r = torch.gather(params["radii"], 1, comp)
        r = r + self.radial_noise * torch.randn(b, num_points, generator=generator)
        u = torch.randn(b, num_points, self.dim, generator=generator)
        u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return params["centers"][:, None, :] + r[..., None] * u

    def sample(self, num_tasks, num_support, num_target, *, generator):
        self._check(num_tasks, num_target)
        m, mask = _ragged_mask(num_tasks, num_support, generator)
        params = self.sample_parameters(num_tasks, generator)
        return _split_points(self.sample_points(params, m + num_target, generator), m, mask)


def _moons(n: int, generator: torch.Generator) -> Tensor:
    """Two interleaved half circles (radius 1), noise 0.08, ``[n, 2]``."""
    upper = torch.rand(n, generator=generator) < 0.5
    theta = math.pi * torch.rand(n, generator=generator)
    x = torch.where(upper, torch.cos(theta), 1.0 - torch.cos(theta))
    y = torch.where(upper, torch.sin(theta), 0.5 - torch.sin(theta))
    pts = torch.stack([x - 0.5, y - 0.25], -1)
    return pts + 0.08 * torch.randn(n, 2, generator=generator)


def _spirals(n: int, generator: torch.Generator) -> Tensor:
    """Two-arm Archimedean spiral, radius up to ~1, noise 0.04, ``[n, 2]``."""
    arm = (torch.rand(n, generator=generator) < 0.5).float()
    s = torch.rand(n, generator=generator).sqrt()
    theta = 0.5 + 3.0 * math.pi * s
    r = theta / (0.5 + 3.0 * math.pi)
    phase = math.pi * arm
    pts = torch.stack([r * torch.cos(theta + phase), r * torch.sin(theta + phase)], -1)
    return pts + 0.04 * torch.randn(n, 2, generator=generator)


class Mixed2DFamily(TaskFamily):
    """The 2-D mixed family: each task is a Gaussian mixture, rings, two moons or a spiral.

    Mixtures and rings come from :class:`GaussianMixtureFamily` / :class:`ShellFamily` in d = 2;
    moons and spirals are placed with a random rotation, a scale ~ U(2, 5) and an offset
    ~ N(0, I).

    Args:
        kinds: Which kinds to draw from, uniformly.
    """

    KINDS = ("mixture", "rings", "moons", "spirals")

    def __init__(self, kinds: tuple[str, ...] = KINDS) -> None:
        unknown = set(kinds) - set(self.KINDS)
        if not kinds or unknown:
            raise ValueError(f"kinds={kinds!r} must be a non-empty subset of {self.KINDS}.")
        self.dim = 2
        self.kinds = tuple(kinds)
        self._mixture = GaussianMixtureFamily(2)
        self._rings = ShellFamily(2)

    def _one(self, kind: str, num_points: int, generator: torch.Generator) -> Tensor:
        if kind == "mixture":
            params = self._mixture.sample_parameters(1, generator)
            return self._mixture.sample_points(params, num_points, generator)[0]
        if kind == "rings":
            params = self._rings.sample_parameters(1, generator)
            return self._rings.sample_points(params, num_points, generator)[0]
        pts = _moons(num_points, generator) if kind == "moons" else _spirals(num_points, generator)
        angle = 2 * math.pi * torch.rand((), generator=generator)
        c, s = torch.cos(angle), torch.sin(angle)
        rot = torch.stack([c, -s, s, c]).view(2, 2)
        scale = torch.empty(()).uniform_(2.0, 5.0, generator=generator)
        return scale * pts @ rot.T + torch.randn(2, generator=generator)

    def sample(self, num_tasks, num_support, num_target, *, generator):
        self._check(num_tasks, num_target)
        m, mask = _ragged_mask(num_tasks, num_support, generator)
        choice = torch.randint(len(self.kinds), (num_tasks,), generator=generator)
        points = torch.stack([self._one(self.kinds[int(c)], m + num_target, generator) for c in choice])
        return _split_points(points, m, mask)


class FeatureTaskFamily(TaskFamily):
    """Real-feature tasks: one class of a feature matrix is one task.

    Each task picks a class uniformly from ``classes`` and a random permutation of its
    points; the first m_max points are the support (masked to m_b), the next n the targets,
    so support and targets never share a point.

    Args:
        features: ``[N, d]`` features (already projected / standardised).
        labels: ``[N]`` integer class labels.
        classes: Classes this family draws from (e.g. the test classes).
        rotate: Apply a fresh Haar-random rotation of feature space to each task (support and
            targets alike). A training-time augmentation: with few training classes it stops the
            model from memorising them and makes it read the support, while keeping each class's
            covariance spectrum (the shape prior the model can amortise).
    """

    def __init__(self, features: Tensor, labels: Tensor, classes: list[int], *, rotate: bool = False) -> None:
        features = torch.as_tensor(features, dtype=torch.float32)
        labels = torch.as_tensor(labels, dtype=torch.long)
        if features.ndim != 2 or labels.ndim != 1 or features.shape[0] != labels.shape[0]:
            raise ValueError(
                f"features {tuple(features.shape)} and labels {tuple(labels.shape)} must be [N, d] and [N]."
            )
        if not classes:
            raise ValueError("classes is empty; pass at least one class label.")
        self.dim = features.shape[1]
        self.rotate = rotate
        self.classes = [int(c) for c in classes]
        self._points = {}
        for c in self.classes:
            pts = features[labels == c]
            if pts.shape[0] < 2:
                raise ValueError(f"class {c} has {pts.shape[0]} points; every class needs at least 2.")
            self._points[c] = pts

    def min_class_size(self) -> int:
        return min(p.shape[0] for p in self._points.values())

    def sample(self, num_tasks, num_support, num_target, *, generator):
        self._check(num_tasks, num_target)
        m, mask = _ragged_mask(num_tasks, num_support, generator)
        if m + num_target > self.min_class_size():
            raise ValueError(
                f"num_support max {m} + num_target {num_target} exceeds the smallest class size "
                f"{self.min_class_size()}; lower one of them."
            )
        choice = torch.randint(len(self.classes), (num_tasks,), generator=generator)
        rows = []
        for c in choice:
            pts = self._points[self.classes[int(c)]]
            perm = torch.randperm(pts.shape[0], generator=generator)[: m + num_target]
            rows.append(pts[perm])
        points = torch.stack(rows)
        if self.rotate:
            points = points @ _random_rotations((num_tasks,), self.dim, generator)
        return _split_points(points, m, mask)

    def sample_per_class(
        self, tasks_per_class: int, num_support: int, num_target: int, *, generator: torch.Generator
    ) -> tuple[TaskBatch, list[int]]:
        """Exactly ``tasks_per_class`` tasks from every class, in class order (evaluation tasks).

        Each task is a fresh random permutation of its class's points: the first ``num_support``
        are the support, the next ``num_target`` the targets. Tasks of one class share most of their
        points, so they are NOT independent units: test at the level of classes (or seeds).

        Returns:
            ``(tasks [C * tasks_per_class], class label of each task)``.
        """
        if tasks_per_class < 1:
            raise ValueError(f"tasks_per_class={tasks_per_class} must be >= 1.")
        self._check(tasks_per_class * len(self.classes), num_target)
        if num_support + num_target > self.min_class_size():
            raise ValueError(
                f"num_support {num_support} + num_target {num_target} exceeds the smallest class size "
                f"{self.min_class_size()}; lower one of them."
            )
        rows, labels = [], []
        for c in self.classes:
            pts = self._points[c]
            for _ in range(tasks_per_class):
                rows.append(
                    pts[torch.randperm(pts.shape[0], generator=generator)[: num_support + num_target]]
                )
                labels.append(c)
        points = torch.stack(rows)
        if self.rotate:
            points = points @ _random_rotations((points.shape[0],), self.dim, generator)
        return _split_points(points, num_support, None), labels


@dataclass
class FeatureSplits:
    """Train / validation / test feature families, split by class, with the fitted projection."""

    train: FeatureTaskFamily
    val: FeatureTaskFamily | None
    test: FeatureTaskFamily
    explained_variance: float


def load_digits_features() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits: features float64 ``[1797, 64]``, labels int ``[1797]``."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return x.astype(np.float64), y.astype(np.int64)


def load_feature_file(
    path: str | Path, labels_path: str | Path | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Load a user-supplied feature matrix and labels.

    Args:
        path: ``.npz`` with arrays ``features`` and ``labels`` (or ``X`` and ``y``), or a ``.npy``
            feature matrix ``[N, D]`` (then ``labels_path`` is required).
        labels_path: ``.npy`` integer labels ``[N]`` when ``path`` is a ``.npy``.

    Returns:
        ``(features [N, D] float64, labels [N] int64)``.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"feature file {str(path)!r} does not exist; pass an existing .npz or .npy file.")
    try:
        return _read_feature_file(path, labels_path)
    except (EOFError, zipfile.BadZipFile, _Unreadable) as err:  # empty, truncated, or another format
        raise ValueError(
            f"{str(path)!r} (or its labels) is empty, truncated or not a NumPy file of numbers ({err}); "
            "pass a complete .npz or .npy file."
        ) from None


class _Unreadable(Exception):
    """``np.load`` refused the file's content (a damaged header, or pickled objects, never loaded)."""


def _load(file: str | Path) -> Any:
    try:
        return np.load(file)
    except ValueError as err:
        raise _Unreadable(" ".join(str(err).split())[:160]) from None


def _read_feature_file(path: Path, labels_path: str | Path | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`load_feature_file` once the path exists."""
    if path.suffix == ".npz":
        with _load(path) as data:
            keys = set(data.files)
            if {"features", "labels"} <= keys:
                x, y = data["features"], data["labels"]
            elif {"X", "y"} <= keys:
                x, y = data["X"], data["y"]
            else:
                raise ValueError(
                    f"{str(path)!r} has arrays {sorted(keys)}; it needs 'features' and 'labels' "
                    "(or 'X' and 'y')."
                )
    elif path.suffix == ".npy":
        if labels_path is None:
            raise ValueError(f"{str(path)!r} is a .npy feature matrix; pass its labels .npy as labels_path.")
        x, y = _load(path), _load(labels_path)
    else:
        raise ValueError(f"feature file {str(path)!r} must end in .npz or .npy.")
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y)
    if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise ValueError(f"features {x.shape} and labels {y.shape} must be [N, D] and [N] with the same N.")
    if not np.isfinite(x).all():
        raise ValueError(f"features in {str(path)!r} contain NaN or inf; clean them first.")
    if not np.issubdtype(y.dtype, np.integer):
        _, y = np.unique(y, return_inverse=True)
    return x, y.astype(np.int64)


def class_folds(classes: list[int], num_folds: int) -> list[list[int]]:
    """Cross-validation folds over classes: fold k tests ``classes[k::num_folds]``.

    Every class is a test class in exactly one fold; the other folds' classes train that fold's
    model (and fit its projection), so every class of the data set is an independent test unit once.

    Args:
        classes: All class labels (sorted).
        num_folds: Folds, 2 <= num_folds <= len(classes).

    Returns:
        ``num_folds`` lists of test classes (disjoint, together all classes).
    """
    classes = sorted(int(c) for c in classes)
    if not 2 <= num_folds <= len(classes):
        raise ValueError(f"num_folds={num_folds} must be in [2, {len(classes)}] (the number of classes).")
    return [classes[k::num_folds] for k in range(num_folds)]


def make_feature_splits(
    features: np.ndarray,
    labels: np.ndarray,
    *,
    num_components: int = 16,
    train_classes: list[int] | None = None,
    val_classes: list[int] | None = None,
    test_classes: list[int] | None = None,
    test_fraction: float = 0.3,
    rotate_train: bool = False,
) -> FeatureSplits:
    """Project features with a PCA fitted on training classes only, standardise, split by class.

    z = (PCA_k(x) - mean_train) / std_train, where PCA_k, mean_train and std_train are fitted on
    the points of the training classes only (no information from test classes leaks).

    Args:
        features: ``[N, D]``.
        labels: ``[N]`` integer labels.
        num_components: k, the PCA dimension (16 in the paper); at most D.
        train_classes, val_classes, test_classes: Class lists; by default the sorted classes are
            split as the last ``ceil(test_fraction * C)`` for test, the one before for
            validation (when C >= 4) and the rest for training.
        test_fraction: Fraction of classes held out for test when the lists are not given.
        rotate_train: Random-rotation augmentation of training tasks (see :class:`FeatureTaskFamily`).

    Returns:
        The three families and the fraction of training variance the PCA keeps.
    """
    from sklearn.decomposition import PCA

    features = np.asarray(features, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    classes = sorted(int(c) for c in np.unique(labels))
    if train_classes is None or test_classes is None:
        n_test = max(1, math.ceil(test_fraction * len(classes)))
        n_val = 1 if len(classes) >= 4 else 0
        if len(classes) - n_test - n_val < 1:
            raise ValueError(f"labels have {len(classes)} classes; at least 2 are needed to split by class.")
        test_classes = classes[len(classes) - n_test :]
        val_classes = classes[len(classes) - n_test - n_val : len(classes) - n_test] or None
        train_classes = classes[: len(classes) - n_test - n_val]
    overlap = set(train_classes) & set(test_classes)
    if overlap:
        raise ValueError(f"train_classes and test_classes share {sorted(overlap)}; splits must be disjoint.")
    if not 1 <= num_components <= features.shape[1]:
        raise ValueError(
            f"num_components={num_components} must be in [1, {features.shape[1]}] (the feature dim)."
        )
    train_rows = np.isin(labels, train_classes)
    pca = PCA(n_components=num_components, random_state=0).fit(features[train_rows])
    z = pca.transform(features)
    mean = z[train_rows].mean(0)
    std = z[train_rows].std(0) + 1e-8
    z = torch.as_tensor((z - mean) / std, dtype=torch.float32)
    y = torch.as_tensor(labels)
    return FeatureSplits(
        train=FeatureTaskFamily(z, y, list(train_classes), rotate=rotate_train),
        val=FeatureTaskFamily(z, y, list(val_classes)) if val_classes else None,
        test=FeatureTaskFamily(z, y, list(test_classes)),
        explained_variance=float(pca.explained_variance_ratio_.sum()),
    )
