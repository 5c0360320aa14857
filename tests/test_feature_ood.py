"""Feature-space OOD detectors (`ee.ood`) against scikit-learn's
`EmpiricalCovariance`, SciPy's multivariate normal and a NumPy nearest-neighbour
search on the same features; per member equal to each member alone."""

import numpy as np
import pytest
from scipy import stats
from scipy.special import logsumexp
from sklearn.covariance import EmpiricalCovariance

import eqx_ensemble as ee

RNG = np.random.default_rng(0)
MEMBERS, N, DIM, CLASSES = 2, 240, 5, 3
LABELS = np.arange(N) % CLASSES
# Each member's features: class clusters with a correlated covariance.
MIX = RNG.normal(size=(MEMBERS, DIM, DIM))
CENTRES = 3 * RNG.normal(size=(MEMBERS, CLASSES, DIM))
TRAIN = (np.einsum("mbd,mde->mbe", RNG.normal(size=(MEMBERS, N, DIM)), MIX)
         + CENTRES[:, LABELS]).astype(np.float32)  # fmt: skip
TEST = (np.einsum("mbd,mde->mbe", RNG.normal(size=(MEMBERS, 50, DIM)), MIX)
        + CENTRES[:, np.arange(50) % CLASSES]).astype(np.float32)  # fmt: skip
FAR = (TEST + 25.0).astype(np.float32)


def test_mahalanobis_is_sklearns_empirical_covariance_of_the_centred_features():
    detector = ee.ood.fit_mahalanobis(TRAIN, LABELS)
    scores = np.asarray(detector(TEST))
    assert scores.shape == (MEMBERS, 50)
    for m in range(MEMBERS):
        f = TRAIN[m].astype(np.float64)
        means = np.stack([f[LABELS == c].mean(0) for c in range(CLASSES)])
        cov = EmpiricalCovariance(assume_centered=True).fit(f - means[LABELS])
        expected = np.min(
            [cov.mahalanobis(TEST[m] - means[c]) for c in range(CLASSES)], axis=0
        )
        np.testing.assert_allclose(scores[m], expected, rtol=2e-4)


@pytest.mark.parametrize("smallest", [1e-3, 1e-4])
def test_mahalanobis_of_features_on_very_different_scales(smallest):
    # float32 `c' P c` cancelled: 0.75% off scikit-learn for feature scales 1
    # to 1e-3, 71% at 1e-4. Scales spread over the features, then a rotation.
    rng = np.random.default_rng(2)
    scales = np.geomspace(1.0, smallest, DIM)
    rotation = np.linalg.qr(rng.normal(size=(DIM, DIM)))[0]
    train = (rng.normal(size=(1, N, DIM)) * scales) @ rotation
    test = (rng.normal(size=(1, 50, DIM)) * scales) @ rotation
    train, test = train.astype(np.float32), test.astype(np.float32)
    scores = np.asarray(ee.ood.fit_mahalanobis(train, LABELS)(test))[0]
    f = train[0].astype(np.float64)
    means = np.stack([f[LABELS == c].mean(0) for c in range(CLASSES)])
    cov = EmpiricalCovariance(assume_centered=True).fit(f - means[LABELS])
    expected = np.min(
        [cov.mahalanobis(test[0] - means[c]) for c in range(CLASSES)], axis=0
    )
    np.testing.assert_allclose(scores, expected, rtol=1e-3)


def test_ddu_density_is_the_class_weighted_gaussian_mixture():
    detector = ee.ood.fit_gaussian_density(TRAIN, LABELS)
    scores = np.asarray(detector(TEST))
    for m in range(MEMBERS):
        f = TRAIN[m].astype(np.float64)
        log_terms = []
        for c in range(CLASSES):
            members_of_c = f[LABELS == c]
            cov = np.cov(members_of_c, rowvar=False, bias=True)
            log_terms.append(
                np.log(np.mean(LABELS == c))
                + stats.multivariate_normal(members_of_c.mean(0), cov).logpdf(TEST[m])
            )
        np.testing.assert_allclose(scores[m], -logsumexp(log_terms, axis=0), rtol=1e-4)


def test_knn_is_the_kth_distance_between_normalised_features():
    detector = ee.ood.fit_knn(TRAIN, k=7)
    scores = np.asarray(detector(TEST))
    for m in range(MEMBERS):
        bank = TRAIN[m] / np.linalg.norm(TRAIN[m], axis=1, keepdims=True)
        query = TEST[m] / np.linalg.norm(TEST[m], axis=1, keepdims=True)
        distances = np.linalg.norm(query[:, None] - bank[None], axis=-1)
        np.testing.assert_allclose(
            scores[m], np.sort(distances, axis=1)[:, 6], atol=2e-3
        )


def test_members_are_fitted_independently_and_far_points_score_high():
    for fit in (
        lambda f: ee.ood.fit_mahalanobis(f, LABELS),
        lambda f: ee.ood.fit_gaussian_density(f, LABELS),
    ):
        together = np.asarray(fit(TRAIN)(TEST))
        alone = np.asarray(fit(TRAIN[1:])(TEST[1:]))
        np.testing.assert_allclose(together[1:], alone, rtol=1e-5)
        detector = fit(TRAIN)
        auroc = ee.metrics.ood_auroc(detector(TEST).mean(0), detector(FAR).mean(0))
        assert auroc == 1.0


def test_a_class_seen_once_gets_a_finite_density():
    # One example: its covariance is zero; the jitter makes it a finite,
    # narrow Gaussian (DDU's fallback), so no score is NaN.
    labels = np.where(np.arange(N) == 0, 3, LABELS)
    scores = np.asarray(ee.ood.fit_gaussian_density(TRAIN, labels)(TEST))
    assert np.isfinite(scores).all()


def test_bad_input_is_refused():
    # Refused by the annotations under the jaxtyping hook, else by the checks.
    with pytest.raises(
        (TypeError, ValueError), match="members batch dim|members, batch"
    ):
        ee.ood.fit_mahalanobis(TRAIN[0], LABELS)
    with pytest.raises((TypeError, ValueError), match="labels"):
        ee.ood.fit_mahalanobis(TRAIN, LABELS[:-1])
    with pytest.raises(ValueError, match=r"classes \[1\]"):
        ee.ood.fit_gaussian_density(TRAIN, np.where(LABELS == 1, 2, LABELS))
    with pytest.raises(ValueError, match="`k`"):
        ee.ood.fit_knn(TRAIN, k=N + 1)
    with pytest.raises(ValueError, match="at least one example"):
        ee.ood.fit_mahalanobis(TRAIN[:, :0], LABELS[:0])
    with pytest.raises(ValueError, match="`jitter` must be a finite"):
        ee.ood.fit_gaussian_density(TRAIN, LABELS, jitter=float("nan"))
    detector = ee.ood.fit_mahalanobis(TRAIN, LABELS)
    with pytest.raises(ValueError, match="fitted on 2 members"):
        detector(TEST[:1])
    bad = TRAIN.copy()
    bad[0, 3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        ee.ood.fit_knn(bad)
    # Fitted on finite features, a NaN feature is refused, not scored NaN.
    nan_test = TEST.copy()
    nan_test[1, 4, 2] = np.nan
    for fitted in (
        detector,
        ee.ood.fit_gaussian_density(TRAIN, LABELS),
        ee.ood.fit_knn(TRAIN, k=np.int64(5)),  # a NumPy integer is an int
    ):
        with pytest.raises(ValueError, match="member 1, example 4"):
            fitted(nan_test)


def test_penultimate_features_are_each_members_own():
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(1), (30, 2))

    def by_hand(model, xs):
        def one(xi):
            for layer in model.layers[:-1]:
                xi = model.activation(layer(xi))
            return xi

        return jax.vmap(one)(xs)

    # An MLP whose final activation would change the output: left out too.
    mlps = ee.ensemble(
        lambda k: eqx.nn.MLP(2, 3, 16, 2, final_activation=jax.nn.softmax, key=k),
        size=3,
        key=jax.random.key(0),
    )
    got = ee.ood.penultimate_features(mlps, x)
    assert got.shape == (3, 30, 16)
    for i in range(3):
        np.testing.assert_allclose(got[i], by_hand(mlps[i], x), atol=1e-6)

    def sequential(key):
        k1, k2 = jax.random.split(key)
        return eqx.nn.Sequential([eqx.nn.Linear(2, 8, key=k1),
                                  eqx.nn.Lambda(jnp.tanh),
                                  eqx.nn.Linear(8, 1, key=k2)])  # fmt: skip

    seqs = ee.ensemble(sequential, size=2, key=jax.random.key(2))
    got = ee.ood.penultimate_features(seqs, x)
    for i in range(2):
        member = seqs[i]
        expected = jnp.tanh(jax.vmap(member.layers[0])(x))
        np.testing.assert_allclose(got[i], expected, atol=1e-6)
    # Members sharing their first layer: the shared part is kept.
    shared = ee.ensemble(
        lambda k: eqx.nn.MLP(2, 3, 16, 2, key=k),
        size=2,
        key=jax.random.key(3),
        shared=lambda m: m.layers[0],
    )
    got = ee.ood.penultimate_features(shared, x)
    for i in range(2):
        np.testing.assert_allclose(got[i], by_hand(shared[i], x), atol=1e-6)
    with pytest.raises(TypeError, match="eqx.nn.MLP or eqx.nn.Sequential"):
        ee.ood.penultimate_features(
            ee.ensemble(lambda k: eqx.nn.Linear(2, 2, key=k), size=2,
                        key=jax.random.key(0)), x)  # fmt: skip
