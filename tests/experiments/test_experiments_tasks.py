"""Task generators: statistics (means, radii, anisotropy), masks, splits, feature loading."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nw_adapter.experiments.tasks import (
    FeatureTaskFamily,
    GaussianMixtureFamily,
    Mixed2DFamily,
    ShellFamily,
    load_feature_file,
    make_feature_splits,
    split_generator,
)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_mixture_means_have_scale_five():
    fam = GaussianMixtureFamily(3)
    params = fam.sample_parameters(2000, gen())
    means = params["means"].reshape(-1, 3)
    assert means.mean(0).abs().max() < 0.2
    assert means.std(0).sub(5.0).abs().max() < 0.2
    k = params["num_components"]
    assert k.min() == 2 and k.max() == 8


@pytest.mark.parametrize("d", [2, 5])
def test_single_component_matches_its_mean_and_anisotropic_covariance(d):
    fam = GaussianMixtureFamily(d, components=(1, 1))
    params = fam.sample_parameters(1, gen(1))
    pts = fam.sample_points(params, 40000, gen(2))[0].double()
    assert torch.allclose(pts.mean(0), params["means"][0, 0].double(), atol=0.05)
    eig = torch.linalg.eigvalsh(torch.cov(pts.T))
    std = params["stds"][0, 0].double()
    torch.testing.assert_close(eig.sqrt(), std.sort().values, rtol=0.05, atol=0.01)
    ratio = float(std.max() / std.min())
    assert 3.0 <= ratio <= 10.0
    assert float(eig.max() / eig.min()) > 8.0  # (aspect >= 3)^2


def test_mixture_component_weights_are_equal():
    fam = GaussianMixtureFamily(2, components=(4, 4), std_range=(0.01, 0.02))
    params = fam.sample_parameters(1, gen(3))
    pts = fam.sample_points(params, 8000, gen(4))[0]
    nearest = torch.cdist(pts, params["means"][0]).argmin(-1)
    frac = torch.bincount(nearest, minlength=8)[:4].float() / 8000
    assert torch.allclose(frac, torch.full((4,), 0.25), atol=0.03)


@pytest.mark.parametrize("d", [8, 32])
def test_shell_radii_and_radial_noise(d):
    fam = ShellFamily(d)
    params = fam.sample_parameters(500, gen(5))
    k = params["num_shells"]
    assert k.min() == 2 and k.max() == 5
    valid = torch.arange(5)[None] < k[:, None]
    radii = params["radii"][valid]
    assert 2.0 <= radii.min() and radii.max() <= 8.0
    assert abs(float(radii.mean()) - 5.0) < 0.2
    one = {key: v[:1] for key, v in params.items()}
    pts = fam.sample_points(one, 20000, gen(6))[0]
    r = pts.norm(dim=-1)
    shells = params["radii"][0, : int(k[0])]
    resid = (r[:, None] - shells[None]).abs().min(-1).values
    assert 0.2 < float(resid.square().mean().sqrt()) < 0.33  # radial noise 0.3 (slightly cut by assignment)
    directions = pts / r[:, None]
    assert directions.mean(0).abs().max() < 0.05  # uniform on the sphere


def test_ragged_support_masks_and_padding():
    fam = GaussianMixtureFamily(4)
    tb = fam.sample(64, (3, 9), 5, generator=gen(7))
    assert tb.support.shape == (64, 9, 4) and tb.target.shape == (64, 5, 4)
    sizes = tb.support_sizes()
    assert sizes.min() == 3 and sizes.max() == 9
    assert torch.all(tb.support[~tb.support_mask] == 0)
    one = tb.task(0)
    assert one.support.shape[1] == int(sizes[0]) and one.support_mask is None
    full = fam.sample(2, 6, 5, generator=gen(7))
    assert full.support_mask is None


def test_split_by_seed_is_reproducible_and_disjoint():
    fam = ShellFamily(8)
    a = fam.sample(4, 10, 10, generator=split_generator(0, "test"))
    b = fam.sample(4, 10, 10, generator=split_generator(0, "test"))
    c = fam.sample(4, 10, 10, generator=split_generator(0, "train"))
    assert torch.equal(a.support, b.support)
    assert not torch.allclose(a.support, c.support)
    with pytest.raises(ValueError, match="split"):
        split_generator(0, "dev")


def test_mixed_2d_family_draws_every_kind():
    fam = Mixed2DFamily()
    tb = fam.sample(24, 30, 20, generator=gen(8))
    assert tb.support.shape == (24, 30, 2) and torch.isfinite(tb.support).all()
    seen = set()
    g = gen(9)
    for _ in range(40):
        seen.add(fam.kinds[int(torch.randint(len(fam.kinds), (1,), generator=g))])
    assert seen == set(Mixed2DFamily.KINDS)
    with pytest.raises(ValueError, match="kinds"):
        Mixed2DFamily(("blobs",))


def test_digits_splits_pca_on_train_classes_only():
    from nw_adapter.experiments.tasks import load_digits_features

    x, y = load_digits_features()
    splits = make_feature_splits(x, y, num_components=16)
    assert set(splits.train.classes).isdisjoint(splits.test.classes)
    assert splits.train.dim == 16 and 0.5 < splits.explained_variance <= 1.0
    train_pts = torch.cat([splits.train._points[c] for c in splits.train.classes])
    assert train_pts.mean(0).abs().max() < 1e-4
    assert (train_pts.std(0) - 1).abs().max() < 1e-2
    tb = splits.test.sample(3, 20, 100, generator=gen(10))
    for i in range(3):
        pts = torch.cat([tb.support[i], tb.target[i]])
        assert torch.unique(pts, dim=0).shape[0] == 120  # support and targets never share a point
        cls = [
            c
            for c in splits.test.classes
            if (splits.test._points[c][:, None] == tb.support[i][None]).all(-1).any()
        ]
        assert len(cls) == 1
    with pytest.raises(ValueError, match="smallest class"):
        splits.test.sample(1, 100, 100, generator=gen(0))


def test_user_feature_files(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(90, 20))
    y = np.repeat(["a", "b", "c"], 30)
    np.savez(tmp_path / "f.npz", features=x, labels=y)
    fx, fy = load_feature_file(tmp_path / "f.npz")
    assert fx.shape == (90, 20) and sorted(set(fy.tolist())) == [0, 1, 2]
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.repeat([0, 1, 2], 30))
    fx2, _ = load_feature_file(tmp_path / "x.npy", tmp_path / "y.npy")
    assert np.array_equal(fx, fx2)
    splits = make_feature_splits(fx, fy, num_components=8)
    assert splits.test.classes == [2] and splits.train.classes == [0, 1] and splits.val is None
    with pytest.raises(ValueError, match="labels"):
        load_feature_file(tmp_path / "x.npy")
    with pytest.raises(ValueError, match="does not exist"):
        load_feature_file(tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="features"):
        FeatureTaskFamily(torch.zeros(5, 2), torch.zeros(4), [0])


def test_sample_per_class_gives_exactly_that_many_tasks_of_each_class():
    x = torch.arange(60, dtype=torch.float32)[:, None].repeat(1, 2)
    y = torch.arange(60) // 20  # classes 0, 1, 2 with 20 points each; a point's class = its value // 20
    fam = FeatureTaskFamily(x, y, [0, 1, 2])
    tasks, labels = fam.sample_per_class(4, 5, 6, generator=torch.Generator().manual_seed(0))
    assert labels == [0] * 4 + [1] * 4 + [2] * 4
    assert tasks.support.shape == (12, 5, 2) and tasks.target.shape == (12, 6, 2)
    for i, c in enumerate(labels):
        pts = torch.cat([tasks.support[i], tasks.target[i]])[:, 0]
        assert bool(((pts // 20) == c).all()) and pts.unique().numel() == 11  # one class, no shared point
    with pytest.raises(ValueError, match="smallest class"):
        fam.sample_per_class(1, 15, 6, generator=torch.Generator().manual_seed(0))
