"""SNGP (`ee.nn.BoundedSpectralNorm`, `RandomFeatureGP`, `gp_covariance`,
`gp_variance`, `mean_field_logits`) against references written independently:
exact Gaussian-process regression in NumPy on the layer's random features, the
RBF kernel the features approximate, the Laplace precision and the mean-field
formula in NumPy, the bounded layer's Jacobian's singular values; an ensemble
of SNGP classifiers trained in one `fit`, member by member, and resumed."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Interrupt, interrupt_at

import eqx_ensemble as ee

BOUND = 0.9
ITERATIONS = 1


def _features(head, x):
    return np.asarray(jax.vmap(head.features)(jnp.asarray(x, jnp.float32)), np.float64)


def test_regression_posterior_is_exact_gp_regression_on_the_features():
    rng = np.random.default_rng(0)
    x, x_test = rng.normal(size=(40, 3)), rng.normal(size=(7, 3)) * 2
    y = np.sin(x.sum(1)) + 0.1 * rng.normal(size=40)
    noise = 0.1
    head = ee.nn.RandomFeatureGP(3, 1, 64, lengthscale=0.7, key=jax.random.key(0))
    phi, phi_test = _features(head, x), _features(head, x_test)
    # Exact GP regression with the kernel k(x, x') = phi(x) . phi(x').
    k, k_star = phi @ phi.T, phi @ phi_test.T
    solve = np.linalg.solve(k + noise * np.eye(40), np.column_stack([y, k_star]))
    mean_ref = k_star.T @ solve[:, 0]
    var_ref = np.sum(phi_test**2, 1) - np.sum(k_star * solve[:, 1:], 0)

    f32 = lambda a: jnp.asarray(a, jnp.float32)
    sigma = ee.nn.gp_covariance(f32(phi), noise_variance=noise)
    mean = phi_test @ (np.asarray(sigma, np.float64) @ phi.T @ y) / noise  # docstring
    var = ee.nn.gp_variance(sigma, f32(phi_test))
    np.testing.assert_allclose(mean, mean_ref, atol=2e-4)
    np.testing.assert_allclose(np.asarray(var), var_ref, rtol=1e-3, atol=1e-5)
    assert var_ref.min() > 1e-2  # not a trivially small variance
    # A prior variance s scales the kernel: the GP with kernel s phi . phi'.
    scaled = ee.nn.gp_covariance(f32(phi), prior_variance=2.0, noise_variance=noise)
    gram = 2 * k + noise * np.eye(40)
    var2 = 2 * np.sum(phi_test**2, 1) - np.sum(
        2 * k_star * np.linalg.solve(gram, 2 * k_star), 0
    )
    np.testing.assert_allclose(ee.nn.gp_variance(scaled, f32(phi_test)), var2,
                               rtol=1e-3, atol=1e-5)  # fmt: skip


def test_random_features_approximate_the_rbf_kernel():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 3))
    lengthscale = 1.5
    head = ee.nn.RandomFeatureGP(3, 2, 16384, lengthscale=lengthscale,
                                 key=jax.random.key(1))  # fmt: skip
    phi = _features(head, x)
    squared = np.sum((x[:, None] - x[None]) ** 2, -1)
    rbf = np.exp(-squared / (2 * lengthscale**2))
    np.testing.assert_allclose(phi @ phi.T, rbf, atol=0.04)  # D^-1/2 = 0.008
    out = jax.vmap(head)(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(out, phi @ np.asarray(head.beta).T, rtol=1e-4,
                               atol=1e-6)  # fmt: skip


def test_laplace_precision_and_mean_field_match_numpy():
    rng = np.random.default_rng(2)
    phi = rng.normal(size=(2, 30, 8)) / 3  # two members
    for classes in (1, 4):
        logits = rng.normal(size=(2, 30, classes)) * 2
        if classes == 1:
            p = 1 / (1 + np.exp(-logits[..., 0]))
        else:
            p = np.max(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True), -1)
        weights = p * (1 - p)
        for m in range(2):
            precision = np.eye(8) / 0.5 + (weights[m, :, None] * phi[m]).T @ phi[m]
            got = ee.nn.gp_covariance(
                jnp.asarray(phi, jnp.float32),
                jnp.asarray(logits, jnp.float32),
                prior_variance=0.5,
            )[m]
            np.testing.assert_allclose(got, np.linalg.inv(precision), rtol=1e-4,
                                       atol=1e-6)  # fmt: skip
    variance = rng.uniform(0, 10, size=(2, 30))
    got = ee.nn.mean_field_logits(
        jnp.asarray(logits, jnp.float32), jnp.asarray(variance, jnp.float32)
    )
    expected = logits / np.sqrt(1 + np.pi / 8 * variance)[..., None]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def _linear_map(layer, state):
    """The weight as the layer applies it (in inference mode: no power-iteration
    step): the Jacobian of `x -> layer(x)`."""
    layer, size = eqx.nn.inference_mode(layer), layer.norm.layer.in_features
    return np.asarray(jax.jacfwd(lambda x: layer(x, state)[0])(jnp.zeros(size)))


def _converged(layer, state, iterations=300):
    """`state` after `iterations` more power iterations on the layer's weight."""
    x = jnp.zeros(layer.norm.layer.in_features)
    step = lambda _, state: layer(x, state)[1]
    return eqx.filter_jit(jax.lax.fori_loop)(0, iterations, step, state)


def test_bounded_spectral_norm_leaves_a_small_weight_alone():
    def make(scale):
        linear = eqx.nn.Linear(5, 4, key=jax.random.key(3))
        linear = eqx.tree_at(lambda m: m.weight, linear, linear.weight * scale)
        norm = eqx.nn.SpectralNorm(linear, "weight", key=jax.random.key(4))
        return eqx.nn.make_with_state(ee.nn.BoundedSpectralNorm)(norm, BOUND)

    small, state = make(1.0)
    raw = np.asarray(small.norm.layer.weight)
    small, state = make(0.5 * BOUND / np.linalg.norm(raw, 2))  # sigma = 0.45
    np.testing.assert_allclose(
        _linear_map(small, state), small.norm.layer.weight, rtol=1e-5
    )
    large, state = make(3 * BOUND / np.linalg.norm(raw, 2))  # sigma = 2.7
    top = np.linalg.norm(_linear_map(large, state), 2)
    assert top == pytest.approx(BOUND, rel=1e-3)


def _make(key):
    k = jax.random.split(key, 5)

    def hidden(n_in, n_out, k1, k2):
        linear = eqx.nn.Linear(n_in, n_out, key=k1)
        norm = eqx.nn.SpectralNorm(linear, "weight", ITERATIONS, key=k2)
        return ee.nn.BoundedSpectralNorm(norm, BOUND)

    relu = eqx.nn.Lambda(jax.nn.relu)
    return eqx.nn.Sequential([
        hidden(2, 16, k[0], k[1]), relu, hidden(16, 16, k[2], k[3]), relu,
        ee.nn.RandomFeatureGP(16, 3, 64, key=k[4]),
    ])  # fmt: skip


def _loss(model, state, batch, key):
    x, y = batch
    logits, state = jax.vmap(model, in_axes=(0, None), out_axes=(0, None))(x, state)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state


def _data():
    x = jax.random.normal(jax.random.key(5), (128, 2))
    y = (x[:, 0] > 0).astype(jnp.int32) + (x[:, 1] > 0).astype(jnp.int32)
    return x, y


def _fit(directory, callbacks=()):
    ens, state = ee.ensemble(eqx.nn.make_with_state(_make), size=3,
                             key=jax.random.key(6))  # fmt: skip
    return ee.fit(ens, _loss, optax.adamw(1e-2, weight_decay=0.1), _data(), steps=60,
                  batch_size=32, key=jax.random.key(7), state=state,
                  checkpoints=ee.Checkpoints(directory, every=20),
                  execution=ee.Execution(steps_per_dispatch=20),
                  callbacks=list(callbacks))  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("sngp") / "reference")


def _phi_and_logits(model, state, x):
    """One pass: each input's random features and logits."""
    apply = lambda f: jax.vmap(f, in_axes=(0, None), out_axes=(0, None))
    hidden, _ = apply(model[:-1])(x, state)
    return jax.vmap(model[-1].features)(hidden), jax.vmap(model[-1])(hidden)


def test_an_ensemble_of_sngp_classifiers_trains_in_one_fit(trained):
    losses = trained.history.losses
    assert losses.shape == (60, 3)
    assert (losses[-10:].mean(0) < losses[:10].mean(0) - 0.3).all()  # every member
    start, _ = ee.ensemble(eqx.nn.make_with_state(_make), size=3,
                           key=jax.random.key(6))  # fmt: skip
    end = trained.ensemble
    head, head0 = end.members.layers[-1], start.members.layers[-1]
    # The random features are fixed (AdamW's weight decay included); beta trains.
    np.testing.assert_array_equal(head.seed, head0.seed)
    h = jax.random.normal(jax.random.key(8), (10, 16))
    phi = ee.map(lambda m, h: jax.vmap(m.layers[-1].features)(h), end, h)
    phi0 = ee.map(lambda m, h: jax.vmap(m.layers[-1].features)(h), start, h)
    np.testing.assert_array_equal(phi, phi0)
    assert not np.allclose(head.beta, head0.beta, atol=1e-2)
    assert not np.allclose(phi[0], phi[1])  # members' features differ
    # Each member's hidden layers act with a top singular value <= the bound,
    # though their raw weights grew past it: once the power iteration has
    # converged on the trained weights, to float32 rounding; as trained, one
    # iteration per step trails weights that move by 1e-2 a step (18% over at
    # worst on this run; see the guide).
    for i, (member, state) in enumerate(_members(trained)):
        for layer in (member.layers[0], member.layers[2]):
            assert np.linalg.norm(layer.norm.layer.weight, 2) > 1.2 * BOUND
            as_trained = np.linalg.norm(_linear_map(layer, state), 2)
            assert as_trained <= BOUND * 1.25, (i, as_trained)
            top = np.linalg.norm(_linear_map(layer, _converged(layer, state)), 2)
            assert top == pytest.approx(BOUND, rel=1e-3), (i, top)


def _members(result):
    states = [jax.tree.map(lambda a: a[i], result.state) for i in range(3)]
    return list(zip(ee.unstack(result.ensemble), states, strict=True))


def test_ensemble_posterior_is_each_members_own(trained):
    x, _ = _data()
    model = eqx.nn.inference_mode(trained.ensemble)
    phi, logits = ee.map(_phi_and_logits, model, trained.state, x, in_axes=(0, None))
    covariance = ee.nn.gp_covariance(phi, logits)
    assert covariance.shape == (3, 64, 64)
    far = 6 * jax.random.normal(jax.random.key(9), (50, 2))
    phi_far, logits_far = ee.map(_phi_and_logits, model, trained.state, far,
                                 in_axes=(0, None))  # fmt: skip
    variance, variance_far = (ee.nn.gp_variance(covariance, phi),
                              ee.nn.gp_variance(covariance, phi_far))  # fmt: skip
    # Distance awareness: far from the data, more variance, flatter probabilities.
    assert (variance_far.mean(1) > 3 * variance.mean(1)).all()
    adjusted = ee.nn.mean_field_logits(logits_far, variance_far)
    assert (jnp.abs(adjusted) <= jnp.abs(logits_far)).all()
    for i, (member, state) in enumerate(_members(trained)):
        member = eqx.nn.inference_mode(member)
        phi_i, logits_i = _phi_and_logits(member, state, x)
        np.testing.assert_allclose(phi_i, phi[i], rtol=1e-5, atol=1e-6)
        alone = ee.nn.gp_covariance(phi_i, logits_i)
        np.testing.assert_allclose(alone, covariance[i], rtol=1e-3, atol=1e-5)
    assert not np.allclose(covariance[0], covariance[1], atol=1e-3)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def test_resume_is_bit_exact(trained, tmp_path):
    with pytest.raises(Interrupt):
        _fit(tmp_path / "run", callbacks=[interrupt_at(40)])
    assert [s for s, _ in ee.list_checkpoints(tmp_path / "run")][-1] == 40
    resumed = _fit(tmp_path / "run")
    for field in ("ensemble", "opt_state", "state"):
        for a, b in zip(_leaves(getattr(resumed, field)),
                        _leaves(getattr(trained, field)), strict=True):  # fmt: skip
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(resumed.history.losses, trained.history.losses)


def test_bad_inputs_are_refused_by_name():
    head = ee.nn.RandomFeatureGP(4, 2, 8, key=jax.random.key(0))
    with pytest.raises(ValueError, match="in_features"):
        head(jnp.ones(5))
    with pytest.raises(ValueError, match="lengthscale"):
        ee.nn.RandomFeatureGP(4, 2, 8, lengthscale=0.0, key=jax.random.key(0))
    with pytest.raises(ValueError, match="lengthscale"):
        ee.nn.RandomFeatureGP(4, 2, 8, lengthscale=-1.0, key=jax.random.key(0))
    with pytest.raises(ValueError, match="num_features"):
        ee.nn.RandomFeatureGP(4, 2, 0, key=jax.random.key(0))
    norm = eqx.nn.SpectralNorm(eqx.nn.Linear(2, 2, key=jax.random.key(0)), "weight",
                               key=jax.random.key(1))  # fmt: skip
    with pytest.raises(ValueError, match="bound"):
        ee.nn.BoundedSpectralNorm(norm, -1.0)
    phi = jnp.ones((2, 5, 3))
    with pytest.raises((ValueError, TypeError), match="logits"):
        ee.nn.gp_covariance(phi, jnp.ones((2, 4, 3)))
    for name in ("prior_variance", "noise_variance"):
        with pytest.raises(ValueError, match=name):
            ee.nn.gp_covariance(phi, **{name: 0.0})
    with pytest.raises((ValueError, TypeError), match="covariance|features"):
        ee.nn.gp_variance(jnp.ones((2, 4, 4)), phi)
    with pytest.raises((ValueError, TypeError), match="variance|logits"):
        ee.nn.mean_field_logits(jnp.ones((5, 3)), jnp.ones(4))
