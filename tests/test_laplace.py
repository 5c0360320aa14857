"""`ee.laplace` against independent references: a dense GGN built by hand with
`jax.jacfwd`, the closed-form evidence of Bayesian linear regression, predictive
formulas written out, members fitted alone, and the sample covariance."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import alternating, tree_equal
from jax.flatten_util import ravel_pytree
from scipy.optimize import minimize_scalar
from scipy.stats import multivariate_normal

import eqx_ensemble as ee


@pytest.fixture(scope="module")
def small():
    x = jax.random.normal(jax.random.key(0), (12, 3))
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(3, 3, 4, 1, activation=jnp.tanh, key=k),
        size=2,
        key=jax.random.key(1),
    )
    labels = jnp.arange(12) % 3
    return ens, x, labels


def _last(model):
    return model.layers[-1]


def dense_ggn(model, part, x, likelihood, sigma=1.0):
    """Sum over examples of J^T Lambda J, J by `jax.jacfwd` of the flattened part."""
    selected = part(model)
    arrays, static = eqx.partition(selected, eqx.is_inexact_array)
    theta, unravel = ravel_pytree(arrays)

    def output(t, xi):
        new = eqx.tree_at(part, model, eqx.combine(unravel(t), static))
        return jnp.reshape(new(xi), (-1,))

    total = 0.0
    for xi in x:
        jac = np.asarray(jax.jacfwd(output)(theta, xi), np.float64)
        f = np.asarray(output(theta, xi), np.float64)
        if likelihood == "classification":
            p = np.exp(f - f.max()) / np.exp(f - f.max()).sum()
            lam = np.diag(p) - np.outer(p, p)
        else:
            lam = np.eye(len(f)) / sigma**2
        total = total + jac.T @ lam @ jac
    return total, theta, output


@pytest.mark.parametrize(
    "where,curvature", alternating(["last", "first"], ["diagonal", "full"])
)
def test_diagonal_and_full_equal_the_dense_ggn(small, curvature, where):
    ens, x, labels = small
    part = _last if where == "last" else (lambda m: m.layers[0])
    posterior = ee.laplace(
        ens, (x, labels), likelihood="classification", part=part,
        curvature=curvature, prior_precision=1.0,
    )  # fmt: skip
    got = np.asarray(posterior.curvature_matrix())
    for i in range(len(ens)):
        expected, theta, _ = dense_ggn(ens[i], part, x, "classification")
        np.testing.assert_allclose(posterior.mean[i], theta, rtol=1e-6)
        if curvature == "diagonal":
            expected = np.diag(np.diag(expected))
        np.testing.assert_allclose(got[i], expected, atol=2e-5, rtol=1e-4)


def _kfac_by_hand(model, x, lam_mean_over):
    """G (x) A over (out, in + 1) row-major, mapped to the flattened part's
    order (weight row-major, then bias), from the hidden activations."""
    hidden = np.asarray(
        jax.vmap(lambda xi: jnp.tanh(model.layers[0](xi)))(x), np.float64
    )
    phi = np.concatenate([hidden, np.ones((len(x), 1))], axis=1)
    a = phi.T @ phi
    g = lam_mean_over
    dense = np.kron(g, a)
    out_size, columns = g.shape[0], phi.shape[1]
    order = [o * columns + i for o in range(out_size) for i in range(columns - 1)]
    order += [o * columns + columns - 1 for o in range(out_size)]
    return dense[np.ix_(order, order)]


def test_kfac_is_exact_for_regression(small):
    ens, x, _ = small
    y = jnp.zeros((12, 3))
    posterior = ee.laplace(
        ens, (x, y), likelihood="regression", curvature="kfac", sigma_noise=0.7,
        prior_precision=1.0,
    )  # fmt: skip
    for i in range(len(ens)):
        expected, *_ = dense_ggn(ens[i], _last, x, "regression", sigma=0.7)
        np.testing.assert_allclose(
            posterior.curvature_matrix()[i], expected, atol=2e-5, rtol=1e-4
        )
        by_hand = _kfac_by_hand(ens[i], x, np.eye(3) / 0.7**2)
        np.testing.assert_allclose(expected, by_hand, atol=2e-5, rtol=1e-4)


def test_kfac_factors_for_classification(small):
    ens, x, labels = small
    posterior = ee.laplace(
        ens, (x, labels), likelihood="classification", curvature="kfac",
        prior_precision=1.0,
    )  # fmt: skip
    for i in range(len(ens)):
        f = np.asarray(jax.vmap(ens[i])(x), np.float64)
        p = np.exp(f) / np.exp(f).sum(-1, keepdims=True)
        lam = np.mean([np.diag(q) - np.outer(q, q) for q in p], axis=0)
        np.testing.assert_allclose(
            posterior.curvature_matrix()[i],
            _kfac_by_hand(ens[i], x, lam),
            atol=2e-5,
            rtol=1e-4,
        )
    # With one example the Kronecker factorisation is exact.
    one = ee.laplace(
        ens, (x[:1], labels[:1]), likelihood="classification", curvature="kfac",
        prior_precision=1.0,
    )  # fmt: skip
    expected, *_ = dense_ggn(ens[0], _last, x[:1], "classification")
    np.testing.assert_allclose(one.curvature_matrix()[0], expected, atol=2e-6)


@pytest.mark.parametrize("curvature", ["full", "kfac"])
def test_marginal_likelihood_optimum_is_the_closed_form(curvature):
    """Bayesian linear regression: the evidence is known; at the MAP of its
    optimal prior precision, the Laplace evidence is exact and its optimum is
    that prior precision."""
    rng = np.random.default_rng(0)
    n, d, sigma = 60, 3, 0.5
    x = rng.normal(size=(n, d))
    y = x @ np.array([0.8, -0.3, 0.2]) + sigma * rng.normal(size=n)

    def log_evidence(delta):
        cov = sigma**2 * np.eye(n) + x @ x.T / delta
        return multivariate_normal(np.zeros(n), cov).logpdf(y)

    search = minimize_scalar(
        lambda log_delta: -log_evidence(np.exp(log_delta)),
        bounds=(-8, 8), method="bounded", options={"xatol": 1e-10},
    )  # fmt: skip
    delta = float(np.exp(search.x))
    precision = x.T @ x / sigma**2 + delta * np.eye(d)
    map_weights = np.linalg.solve(precision, x.T @ y / sigma**2)
    model = eqx.nn.Linear(d, 1, use_bias=False, key=jax.random.key(0))
    model = eqx.tree_at(
        lambda m: m.weight, model, jnp.asarray(map_weights[None], jnp.float32)
    )
    ens = ee.stack([model, model])
    data = (jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
    posterior = ee.laplace(
        ens, data, likelihood="regression",
        prior_precision="marglik", part=lambda m: m, curvature=curvature,
        sigma_noise=sigma,
    )  # fmt: skip
    np.testing.assert_allclose(posterior.prior_precision, delta, rtol=2e-3)
    np.testing.assert_allclose(
        posterior.log_marginal_likelihood(delta), log_evidence(delta), atol=2e-3
    )


def test_linearised_predictive_by_hand(small):
    ens, x, labels = small
    prior = 0.5
    for likelihood, targets in (
        ("classification", labels),
        ("regression", jnp.zeros((12, 3))),
    ):
        posterior = ee.laplace(
            ens, (x, targets), likelihood=likelihood, curvature="full",
            prior_precision=prior, sigma_noise=0.3,
        )  # fmt: skip
        got = posterior.predict(x[:4])
        for i in range(len(ens)):
            h, theta, output = dense_ggn(ens[i], _last, x, likelihood, sigma=0.3)
            covariance = np.linalg.inv(h + prior * np.eye(len(theta)))
            for n in range(4):
                jac = np.asarray(jax.jacfwd(output)(theta, x[n]), np.float64)
                f = np.asarray(output(theta, x[n]), np.float64)
                s = jac @ covariance @ jac.T
                if likelihood == "regression":
                    np.testing.assert_allclose(got[0][i, n], f, rtol=1e-5, atol=1e-6)
                    np.testing.assert_allclose(
                        got[1][i, n], np.diag(s) + 0.3**2, rtol=1e-4
                    )
                else:
                    z = f / np.sqrt(1 + np.pi / 8 * np.diag(s))
                    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
                    # (logits: the predictive's log-probabilities)
                    np.testing.assert_allclose(
                        np.exp(got[i, n]), p, rtol=1e-4, atol=1e-6
                    )
                    np.testing.assert_allclose(
                        jax.nn.logsumexp(got[i, n]), 0.0, atol=1e-6
                    )


def test_mixture_is_each_member_fitted_alone(small):
    ens, x, labels = small
    ens = ee.concatenate([ens, ens[:1]])
    together = ee.laplace(
        ens, (x, labels), likelihood="classification", prior_precision="marglik"
    )
    probs = jax.nn.softmax(together.predict(x), axis=-1)
    for i in range(len(ens)):
        alone = ee.laplace(
            ens[i : i + 1],
            (x, labels),
            likelihood="classification",
            prior_precision="marglik",
        )
        # Member i's objective is the member's own: the same log marginal
        # likelihood at the same prior precision.
        at = together.prior_precision[i]
        np.testing.assert_allclose(
            together.log_marginal_likelihood()[i],
            alone.log_marginal_likelihood(at)[0],
            rtol=1e-5,
        )
        # Its maximiser is searched in float32 on a flat optimum: the two
        # searches end within 0.1-0.2% of each other (CPUs differ in rounding),
        # at the same height.
        np.testing.assert_allclose(at, alone.prior_precision[0], rtol=5e-3)
        np.testing.assert_allclose(
            together.log_marginal_likelihood()[i],
            alone.log_marginal_likelihood()[0],
            rtol=1e-5,
        )
        alone_probs = jax.nn.softmax(alone.predict(x)[0], axis=-1)
        np.testing.assert_allclose(probs[i], alone_probs, rtol=1e-4, atol=1e-5)
    # The mixture's predictive, as the metrics read it, is the members' mean.
    mixture = ee.combine.mean_probs(probs)
    np.testing.assert_allclose(mixture, np.mean(np.asarray(probs), axis=0), atol=1e-6)


@pytest.mark.parametrize("curvature", ["diagonal", "full", "kfac"])
def test_samples_have_the_posterior_covariance(small, curvature):
    ens, x, labels = small
    posterior = ee.laplace(
        ens, (x, labels), likelihood="classification", curvature=curvature,
        prior_precision=2.0,
    )  # fmt: skip
    count = 6000
    draws = posterior.sample(jax.random.key(0), samples=count)
    assert len(draws) == 2 * count
    for i in range(2):
        flat = eqx.filter_vmap(
            lambda m: ravel_pytree(eqx.filter(_last(m), eqx.is_inexact_array))[0]
        )(draws[i * count : (i + 1) * count].members)
        flat = np.asarray(flat, np.float64)
        covariance = np.linalg.inv(
            np.asarray(posterior.curvature_matrix()[i], np.float64) + 2.0 * np.eye(15)
        )
        error = 5 * np.sqrt(np.diag(covariance) / count)
        np.testing.assert_array_less(np.abs(flat.mean(0) - posterior.mean[i]), error)
        np.testing.assert_allclose(
            np.cov(flat, rowvar=False), covariance, atol=0.06 * covariance.max()
        )
    # The rest of each member is unchanged.
    np.testing.assert_array_equal(draws[0].layers[0].weight, ens[0].layers[0].weight)


# ------------------------------------------------------------------ bad input


def test_part_selecting_no_weights(small):
    ens, x, labels = small
    with pytest.raises(ValueError, match="selects no floating-point array"):
        ee.laplace(
            ens, (x, labels), likelihood="classification", prior_precision="marglik",
            part=lambda m: m.activation, curvature="diagonal",
        )  # fmt: skip


@pytest.mark.parametrize("prior", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_prior_precision(small, prior):
    ens, x, labels = small
    with pytest.raises(ValueError, match="prior_precision"):
        ee.laplace(ens, (x, labels), likelihood="classification", prior_precision=prior)
    posterior = ee.laplace(
        ens, (x, labels), likelihood="classification", prior_precision="marglik"
    )
    with pytest.raises(ValueError, match="prior_precision"):
        posterior.log_marginal_likelihood(prior)


def test_kfac_needs_a_linear_part(small):
    ens, x, labels = small
    with pytest.raises(ValueError, match="one `eqx.nn.Linear`"):
        ee.laplace(
            ens,
            (x, labels),
            likelihood="classification",
            prior_precision="marglik",
            part=lambda m: m,
        )


def test_full_curvature_of_a_large_part():
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(3, 2, 1000, 1, key=k), size=1, key=jax.random.key(0)
    )
    x = jnp.ones((4, 3))
    with pytest.raises(ValueError, match="at most 4096"):
        ee.laplace(
            ens, (x, jnp.zeros(4, jnp.int32)), likelihood="classification",
            prior_precision="marglik",
            part=lambda m: m, curvature="full",
        )  # fmt: skip


def test_bad_targets_and_options(small):
    ens, x, labels = small
    with pytest.raises(ValueError, match=r"lie in \[0, 3\)"):
        ee.laplace(
            ens, (x, labels + 1), likelihood="classification", prior_precision="marglik"
        )
    with pytest.raises(TypeError, match="integer labels"):
        ee.laplace(
            ens,
            (x, labels.astype(jnp.float32)),
            likelihood="classification",
            prior_precision="marglik",
        )
    with pytest.raises(ValueError, match="do not match"):
        ee.laplace(
            ens,
            (x, jnp.zeros((12, 2))),
            likelihood="regression",
            prior_precision="marglik",
        )
    with pytest.raises((ValueError, TypeError), match="likelihood"):
        ee.laplace(ens, (x, labels), likelihood="poisson", prior_precision="marglik")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sigma_noise"):
        ee.laplace(ens, (x, jnp.zeros((12, 3))), likelihood="regression",
        prior_precision="marglik",
                   sigma_noise=0.0)  # fmt: skip
    with pytest.raises(ValueError, match="12 examples"):
        ee.laplace(
            ens, (x, labels[:5]), likelihood="classification", prior_precision="marglik"
        )
    # No default prior precision: the marginal likelihood's misleads for
    # weights trained without the matching weight decay (the guide).
    with pytest.raises(TypeError, match=r"needs `validation=\(x, y\)`.*marglik"):
        ee.laplace(ens, (x, labels), likelihood="classification")
    with pytest.raises((ValueError, TypeError), match="prior_precision"):
        ee.laplace(
            ens, (x, labels), likelihood="classification", prior_precision="auto"
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass one of them"):
        ee.laplace(ens, (x, labels), likelihood="classification",
                   prior_precision="marglik", validation=(x, labels))  # fmt: skip
    posterior = ee.laplace(
        ens, (x, labels), likelihood="classification", prior_precision="marglik"
    )
    with pytest.raises(ValueError, match="samples"):
        posterior.predict(x, samples=10)


def test_prior_tuned_on_validation_data_minimises_each_members_nll(small):
    ens, x, labels = small
    posterior = ee.laplace(
        ens, (x, labels), likelihood="classification", prior_precision="marglik"
    )
    grid = np.array([0.1, 1.0, 10.0, 100.0])
    # (Untrained members: more spread always helps, to the grid's end: said.)
    with pytest.warns(ee.PriorAtGridEndWarning, match="lowest prior precision"):
        tuned = posterior.optimize_prior_precision((x[:8], labels[:8]), grid=grid)
    # By hand: each member's validation NLL at every grid value.
    for i in range(len(ens)):
        nlls = []
        for value in grid:
            fixed = ee.laplace(
                ens[i : i + 1], (x, labels), likelihood="classification",
                prior_precision=float(value),
            )  # fmt: skip
            probs = np.asarray(jax.nn.softmax(fixed.predict(x[:8]), axis=-1))[0]
            nlls.append(-np.mean(np.log(probs[np.arange(8), np.asarray(labels[:8])])))
        assert tuned.prior_precision[i] == np.float32(grid[int(np.argmin(nlls))])
    with pytest.raises(ValueError, match="grid"):
        posterior.optimize_prior_precision((x, labels), grid=np.array([0.0, 1.0]))
    # A validation split of three items is named as the validation split (by
    # the annotations under the jaxtyping hook, else by the library's check).
    with pytest.raises(TypeError, match="validation"):
        posterior.optimize_prior_precision((x, labels, labels))
    from eqx_ensemble._posteriors.laplace import _check_data  # (without the hook)

    with pytest.raises(TypeError, match="`validation` must be `\\(x, y\\)`.*3 items"):
        _check_data((x, labels, labels), "classification", "validation")
    with pytest.raises(ValueError, match="validation"):
        posterior.optimize_prior_precision(grid=grid)


def test_shared_part_head_is_approximated_and_backbone_refused():
    x = jax.random.normal(jax.random.key(0), (12, 3))
    labels = jnp.arange(12) % 3
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(3, 3, 4, 1, activation=jnp.tanh, key=k),
        size=2,
        key=jax.random.key(1),
        shared=lambda m: m.layers[0],
    )
    # A per-member head: fitted and sampled as for an ensemble without sharing.
    posterior = ee.laplace(
        ens,
        (x, labels),
        likelihood="classification",
        prior_precision="marglik",
        curvature="diagonal",
    )
    draws = posterior.sample(jax.random.key(2), samples=3)
    assert ee.predict(draws, x).shape == (6, 12, 3)
    # Every draw keeps the shared backbone; member 0's draws are around its head.
    assert tree_equal(draws.shared, ens.shared)
    # The shared backbone has no per-member posterior: refused before any work.
    with pytest.raises(ValueError, match="shared part"):
        ee.laplace(
            ens,
            (x, labels),
            likelihood="classification",
            prior_precision="marglik",
            part=lambda m: m.layers[0],
            curvature="diagonal",
        )


def test_padding_cannot_put_nan_into_the_sums():
    # A model that is not finite at an all-zero input: the last chunk's padding
    # must not be zeros (0 * NaN is NaN).
    class Log(eqx.Module):
        linear: eqx.nn.Linear

        def __call__(self, x):
            return self.linear(jnp.log(x))

    x = jax.random.uniform(jax.random.key(0), (10, 3), minval=0.5, maxval=2.0)
    labels = jnp.arange(10) % 2
    ens = ee.ensemble(
        lambda k: Log(eqx.nn.Linear(3, 2, key=k)), size=2, key=jax.random.key(1)
    )
    whole = ee.laplace(
        ens, (x, labels), likelihood="classification", part=lambda m: m.linear,
        prior_precision=1.0, batch_size=10,
    )  # fmt: skip
    chunked = ee.laplace(
        ens, (x, labels), likelihood="classification", part=lambda m: m.linear,
        prior_precision=1.0, batch_size=4,
    )  # fmt: skip
    # Eigenvectors are defined up to sign: compare what they determine.
    for a, b in [
        (whole.log_likelihood, chunked.log_likelihood),
        (whole.curvature_matrix(), chunked.curvature_matrix()),
        (whole.predict(x), chunked.predict(x)),
    ]:
        assert jnp.all(jnp.isfinite(b))
        assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6)


# Issue 49 item 6: the idiomatic regression head, and a posterior saved.


def _regression_heads():
    x = jax.random.normal(jax.random.key(0), (12, 3))
    y = jnp.sin(x[:, 0])
    make = [
        lambda k, out=out: eqx.nn.MLP(3, out, 4, 1, activation=jnp.tanh, key=k)
        for out in ("scalar", 1)
    ]
    return x, y, [ee.ensemble(m, size=2, key=jax.random.key(1)) for m in make]


def test_kfac_of_a_scalar_head_equals_the_one_output_head():
    # `eqx.nn.MLP(..., "scalar")` ends in a Linear with `out_features="scalar"`:
    # the same weights as a 1-output Linear, whose KFAC posterior is the
    # reference (same factors, evidence, prior and predictive).
    x, y, (scalar, one) = _regression_heads()
    posteriors = [
        ee.laplace(ens, (x, target), likelihood="regression",
        prior_precision="marglik", curvature="kfac",
                   sigma_noise=0.7)
        for ens, target in ((scalar, y), (one, y[:, None]))
    ]  # fmt: skip
    for name in ("out_eigenvalues", "in_eigenvalues", "mean", "log_likelihood",
                 "prior_precision"):  # fmt: skip
        np.testing.assert_allclose(
            getattr(posteriors[0], name), getattr(posteriors[1], name), rtol=1e-6
        )
    (mean_s, var_s), (mean_1, var_1) = (p.predict(x[:5]) for p in posteriors)
    assert mean_s.shape == var_s.shape == (2, 5)
    np.testing.assert_allclose(mean_s, np.reshape(mean_1, (2, 5)), rtol=1e-6)
    np.testing.assert_allclose(var_s, np.reshape(var_1, (2, 5)), rtol=1e-6)


@pytest.mark.parametrize("curvature", ["kfac", "diagonal"])
def test_a_saved_posterior_loads_into_a_template_of_a_fresh_ensemble(
    tmp_path, curvature
):
    x, y, (scalar, _) = _regression_heads()
    posterior = ee.laplace(scalar, (x, y), likelihood="regression",
                           prior_precision="marglik",
                           curvature=curvature, sigma_noise=0.7)  # fmt: skip
    path = ee.save(tmp_path / "posterior.ckpt", posterior)
    # A new process has the architecture, not the trained weights or the data.
    fresh = ee.ensemble(
        lambda k: eqx.nn.MLP(3, "scalar", 4, 1, activation=jnp.tanh, key=k),
        size=2,
        key=jax.random.key(7),
    )
    like = ee.LaplacePosterior.like(fresh, likelihood="regression", curvature=curvature)
    loaded = ee.load(path, like)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(posterior, eqx.is_array)),
        jax.tree.leaves(eqx.filter(loaded, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    assert float(loaded.sigma_noise) == np.float32(0.7) and int(loaded.num_data) == 12
    for a, b in zip(posterior.predict(x[:4]), loaded.predict(x[:4]), strict=True):
        np.testing.assert_array_equal(a, b)
    # Verified like every checkpoint: another curvature's template, or a
    # damaged file, is refused by name.
    other = "diagonal" if curvature == "kfac" else "kfac"
    with pytest.raises(ee.CheckpointError):
        ee.load(path, ee.LaplacePosterior.like(fresh, likelihood="regression",
                                               curvature=other))  # fmt: skip
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ee.CheckpointError):
        ee.load(path, like)


# ------------------------------------ non-finite data; the prior on validation


KEY = jax.random.key(0)
X = jnp.linspace(-1, 1, 32)[:, None]
Y = jnp.sin(3 * X)
ENS = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 8, 1, key=k), size=3, key=KEY)


@pytest.mark.parametrize("where", ["x", "y"])
def test_laplace_refuses_a_nan_in_the_data(where):
    x, y = np.asarray(X).copy(), np.asarray(Y).copy()
    (x if where == "x" else y)[5, 0] = np.nan
    with pytest.raises(ValueError, match=rf"`{where}`.*nan at index \(5, 0\)"):
        ee.laplace(
            ENS,
            (x, y),
            likelihood="regression",
            prior_precision="marglik",
            curvature="diagonal",
        )


def test_laplace_tuned_on_validation_does_not_lose_to_the_members_on_digits():
    # Members trained without weight decay (as usual): the marginal likelihood
    # picks a far too weak prior for them (underconfident); the validation
    # split's prior must give a mixture no worse than the members themselves
    # (their mean test NLL), and it is the one `validation=` selects.
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    images = digits.data[order].astype(np.float32)
    labels = digits.target[order].astype(np.int32)
    mean, std = images[:1000].mean(0), images[:1000].std(0) + 1e-3
    x = jnp.asarray((images - mean) / std)
    y = jnp.asarray(labels)
    train, val, test = (
        (x[:1000], y[:1000]),
        (x[1000:1300], y[1000:1300]),
        (x[1300:], y[1300:]),
    )

    def cross_entropy(model, batch, key):
        xs, ys = batch
        logits = jax.vmap(model)(xs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean()

    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(64, 10, 64, 2, key=k), size=3, key=jax.random.key(0)
    )
    deep = ee.fit(
        ens, cross_entropy, optax.sgd(0.05, momentum=0.9), train, steps=600,
        batch_size=64, key=jax.random.key(1), callbacks=(),
    ).ensemble  # fmt: skip

    def nll(probs):  # the mixture's, and each member's, by hand
        probs = np.asarray(probs, np.float64)
        rows = np.arange(len(test[1]))
        picked = probs[:, rows, np.asarray(test[1])]
        return -np.log(picked.mean(0)).mean(), -np.log(picked).mean(1)

    _, members_own = nll(jax.nn.softmax(ee.predict(deep, test[0]), axis=-1))
    posterior = ee.laplace(deep, train, likelihood="classification", validation=val)
    mixture, _ = nll(jax.nn.softmax(posterior.predict(test[0]), axis=-1))
    assert mixture <= members_own.mean(), (mixture, members_own)
    by_hand = ee.laplace(
        deep, train, likelihood="classification", prior_precision="marglik"
    )
    tuned = by_hand.optimize_prior_precision(val)
    np.testing.assert_array_equal(posterior.prior_precision, tuned.prior_precision)
    with pytest.raises(ValueError, match="pass one of them"):
        ee.laplace(
            deep, train, likelihood="classification", validation=val,
            prior_precision=1.0,
        )  # fmt: skip


def test_the_predictive_is_logits_as_ee_predict_gives(small):
    # Probit and Monte Carlo: log-probabilities (normalised logits), which the
    # metrics take with `from_logits=True`, near each other.
    ens, x, labels = small
    posterior = ee.laplace(
        ens, (x, labels), likelihood="classification", prior_precision="marglik"
    )
    probit = posterior.predict(x)
    drawn = posterior.predict(x, samples=4000, key=jax.random.key(0))
    for logits in (probit, drawn):
        assert logits.shape == ee.predict(ens, x).shape
        np.testing.assert_allclose(jax.nn.logsumexp(logits, axis=-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(np.exp(drawn), np.exp(probit), atol=0.05)
    np.testing.assert_allclose(
        ee.metrics.nll(probit, labels, from_logits=True),
        ee.metrics.nll(jax.nn.softmax(probit, axis=-1), labels),
        rtol=1e-5,
    )
