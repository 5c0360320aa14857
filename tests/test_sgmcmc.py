"""SG-MCMC chains as members: the exact posterior of Bayesian linear regression,
independence of chains (member i against a hand-written single-chain loop),
exact resume, and bad input."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_ensemble as ee

N, D = 40, 2
NOISE_VAR, PRIOR_VAR = 0.25, 1.0


@pytest.fixture(scope="module")
def regression():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, D)).astype(np.float32)
    y = (x @ np.array([1.0, -0.5]) + rng.normal(scale=NOISE_VAR**0.5, size=N)).astype(
        np.float32
    )
    # The closed form: precision A = X'X / s2 + I / t2, mean A^-1 X'y / s2.
    precision = x.T.astype(np.float64) @ x / NOISE_VAR + np.eye(D) / PRIOR_VAR
    covariance = np.linalg.inv(precision)
    mean = covariance @ x.T.astype(np.float64) @ y / NOISE_VAR
    return x, y, mean, covariance


def loss(model, batch, key):
    """Mean NLL + negative log prior / N: N * loss is the negative log posterior."""
    x, y = batch
    residual = y - jax.vmap(model)(x)[:, 0]
    prior = 0.5 * jnp.sum(model.weight**2) / PRIOR_VAR
    return jnp.mean(0.5 * residual**2 / NOISE_VAR) + prior / N


def chains(size, key=0):
    return ee.ensemble(
        lambda k: eqx.nn.Linear(D, 1, use_bias=False, key=k),
        size=size,
        key=jax.random.key(key),
    )


@pytest.mark.parametrize(
    "sampler",
    [
        ee.sgmcmc.sgld(5e-3, num_data=N),
        ee.sgmcmc.sghmc(2.5e-3, num_data=N, friction=0.2),
    ],
    ids=["sgld", "sghmc"],
)
def test_chains_sample_the_exact_posterior(regression, sampler):
    x, y, mean, covariance = regression
    burn_in, spacing, count = 1000, 50, 20
    at = tuple(burn_in + spacing * (i + 1) for i in range(count))
    result = ee.fit(
        chains(64),
        loss,
        sampler,
        (x, y),
        steps=at[-1],
        batch_size=N,  # full batch: exact gradients
        key=jax.random.key(1),
        track=[ee.Snapshots(at=at)],
        callbacks=(),
    )
    samples = np.asarray(result.tracked[0].members.weight[:, 0, :], np.float64)
    assert samples.shape == (64 * count, D)
    # Monte Carlo error: samples of one chain are correlated; count chains only
    # (64 independent means of 20 samples each) for a conservative error bar.
    chain_means = samples.reshape(64, count, D).mean(axis=1)
    standard_error = chain_means.std(axis=0, ddof=1) / np.sqrt(64)
    np.testing.assert_array_less(np.abs(samples.mean(0) - mean), 4 * standard_error)
    empirical = np.cov(samples, rowvar=False)
    # Relative error of a covariance from ~several hundred effective samples is
    # ~10%; the step-size bias (h * lambda / 2) is ~1%.
    np.testing.assert_allclose(np.diag(empirical), np.diag(covariance), rtol=0.25)
    correlation = covariance[0, 1] / np.sqrt(covariance[0, 0] * covariance[1, 1])
    got = empirical[0, 1] / np.sqrt(empirical[0, 0] * empirical[1, 1])
    assert abs(got - correlation) < 0.15


def test_zero_temperature_is_sgd(regression):
    x, y, *_ = regression
    ens = chains(3)
    args = (loss, (x, y))
    sampled = ee.fit(
        ens, *args[:1], ee.sgmcmc.sgld(0.05, num_data=N, temperature=0.0), args[1],
        steps=20, batch_size=N, key=jax.random.key(0), callbacks=(),
    )  # fmt: skip
    sgd = ee.fit(
        ens, loss, optax.sgd(0.05), (x, y), steps=20, batch_size=N,
        key=jax.random.key(0), callbacks=(),
    )  # fmt: skip
    np.testing.assert_allclose(
        sampled.ensemble.members.weight, sgd.ensemble.members.weight, atol=1e-6
    )


@pytest.mark.parametrize("which", ["sgld", "sghmc"])
def test_member_equals_its_chain_run_alone(regression, which):
    """Member i's trajectory depends on its own key only: a hand-written loop over
    ONE model, given member i's keys as documented, reproduces it."""
    x, y, *_ = regression
    make = {
        "sgld": lambda: ee.sgmcmc.sgld(1e-2, num_data=N),
        "sghmc": lambda: ee.sgmcmc.sghmc(1e-2, num_data=N, friction=0.3),
    }[which]
    sampler = make()
    size, steps = 4, 15
    ens = chains(size)
    step = ee.make_step(loss, sampler)
    opt_state = ee.init_optimizer(sampler, ens)
    step_keys = jax.random.split(jax.random.key(7), steps)
    for k in step_keys:
        ens, opt_state, _ = step(ens, opt_state, (x, y), k)[:3]

    for i in range(size):
        model = ee.unstack(chains(size))[i]
        state = sampler.init(eqx.filter(model, eqx.is_array))
        for k in step_keys:
            member_key = jax.random.split(k, size)[i]
            grads = eqx.filter_grad(loss)(model, (x, y), member_key)
            updates, state = sampler.update(
                grads,
                state,
                eqx.filter(model, eqx.is_array),
                key=jax.random.fold_in(member_key, 0x6F707478),
            )
            model = eqx.apply_updates(model, updates)
        np.testing.assert_allclose(
            ens.members.weight[i], model.weight, rtol=1e-5, atol=1e-6
        )


def test_chains_from_one_start_diverge_by_their_own_noise(regression):
    x, y, *_ = regression
    one = eqx.nn.Linear(D, 1, use_bias=False, key=jax.random.key(0))
    ens = ee.stack([one] * 4)
    result = ee.fit(
        ens, loss, ee.sgmcmc.sgld(1e-2, num_data=N), (x, y), steps=50,
        batch_size=N, key=jax.random.key(3), callbacks=(),
    )  # fmt: skip
    weights = np.asarray(result.ensemble.members.weight[:, 0])
    distances = np.abs(weights[:, None] - weights[None]).sum(-1)
    assert (distances + np.eye(4) > 1e-3).all()


def test_sgld_resume_is_bit_exact(regression, tmp_path):
    x, y, *_ = regression
    sampler = ee.sgmcmc.sghmc(1e-2, num_data=N)

    def run(directory, steps):
        return ee.fit(
            chains(3), loss, sampler, (x, y), steps=steps, batch_size=N,
            key=jax.random.key(5), callbacks=(),
            checkpoints=ee.Checkpoints(directory, every=10),
        )  # fmt: skip

    reference = run(tmp_path / "reference", 30)
    run(tmp_path / "run", 10)
    resumed = run(tmp_path / "run", 30)
    np.testing.assert_array_equal(
        resumed.ensemble.members.weight, reference.ensemble.members.weight
    )
    np.testing.assert_array_equal(
        resumed.opt_state.momentum.weight, reference.opt_state.momentum.weight
    )


def test_cyclical_schedule_and_sample_steps():
    temperature = ee.sgmcmc.cyclical_temperature(10, exploration=0.5, temperature=0.5)
    values = [float(temperature(t)) for t in range(20)]
    assert values == ([0.0] * 5 + [0.5] * 5) * 2
    steps = ee.sgmcmc.sample_steps(10, 2, per_cycle=3, spacing=2)
    assert steps == (6, 8, 10, 16, 18, 20)
    # The cyclical sampler: SGD (no noise) in exploration, noise in sampling.
    sampler = ee.sgmcmc.sgld(
        ee.schedules.cosine_cycles(0.1, cycle_steps=10, cycles=2),
        num_data=10,
        temperature=temperature,
    )
    params = {"w": jnp.zeros(3)}
    state = sampler.init(params)
    grads = {"w": jnp.ones(3)}
    for t in range(10):
        updates, state = sampler.update(grads, state, params, key=jax.random.key(t))
        lr = 0.1 / 2 * (np.cos(np.pi * t / 10) + 1)
        noisy = not np.allclose(updates["w"], -lr, atol=1e-7)
        assert noisy == (t >= 5), t


# ------------------------------------------------------------------ bad input


def test_update_without_key_is_refused():
    sampler = ee.sgmcmc.sgld(1e-3, num_data=10)
    params = {"w": jnp.zeros(2)}
    with pytest.raises(ValueError, match="key="):
        sampler.update(params, sampler.init(params), params)


def test_trained_shared_part_gets_no_key(regression):
    x, y, *_ = regression

    class Model(eqx.Module):
        head: eqx.nn.Linear
        body: eqx.nn.Linear

        def __call__(self, v):
            return self.head(self.body(v))

    ens = ee.ensemble(
        lambda k: Model(
            eqx.nn.Linear(3, 1, key=k), eqx.nn.Linear(D, 3, key=jax.random.key(0))
        ),
        size=2,
        key=jax.random.key(0),
        shared=lambda m: m.body,
        train_shared=True,
    )
    with pytest.raises(ValueError, match="shared part"):
        ee.fit(
            ens, lambda m, b, k: jnp.mean((jax.vmap(m)(b[0])[:, 0] - b[1]) ** 2),
            ee.sgmcmc.sgld(1e-3, num_data=N), (x, y), steps=2, batch_size=N,
            key=jax.random.key(0), callbacks=(),
        )  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"learning_rate": float("nan")}, "learning_rate"),
        ({"learning_rate": lambda t: -0.1}, "schedule whose value at step 0"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"num_data": 0}, "num_data"),
    ],
)
def test_bad_sampler_arguments(kwargs, match):
    arguments = {"learning_rate": 1e-3, "num_data": 10, **kwargs}
    learning_rate = arguments.pop("learning_rate")
    with pytest.raises((ValueError, TypeError), match=match):
        ee.sgmcmc.sgld(learning_rate, **arguments)


def test_warmup_schedule_from_zero_is_accepted():
    # A learning-rate warm-up starts at 0: the schedule is in range at step 0.
    warmup = optax.linear_schedule(0.0, 1e-3, 10)
    sampler = ee.sgmcmc.sgld(warmup, num_data=10)
    params = {"w": jnp.zeros(3)}
    state = sampler.init(params)
    updates, _ = sampler.update(
        {"w": jnp.ones(3)}, state, params, key=jax.random.key(0)
    )
    assert jnp.array_equal(updates["w"], jnp.zeros(3))  # lr 0: no step, no noise
    ee.sgmcmc.sghmc(warmup, num_data=10)


def test_sghmc_with_friction_one_is_sgld():
    params = {"w": jnp.zeros(4)}
    grads = {"w": jnp.arange(4.0)}
    key = jax.random.key(5)
    steps = []
    for sampler in (
        ee.sgmcmc.sgld(1e-2, num_data=10),
        ee.sgmcmc.sghmc(1e-2, num_data=10, friction=1.0),
    ):
        updates, _ = sampler.update(grads, sampler.init(params), params, key=key)
        steps.append(updates["w"])
    assert jnp.allclose(steps[0], steps[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("friction", [0.0, 1.5, -0.1])
def test_bad_friction(friction):
    with pytest.raises(ValueError, match="friction"):
        ee.sgmcmc.sghmc(1e-3, num_data=10, friction=friction)


def test_bad_cycles():
    with pytest.raises(ValueError, match="exploration"):
        ee.sgmcmc.cyclical_temperature(10, exploration=1.0)
    # 0.95 of a 10-step cycle rounds up to the whole cycle: no sampling stage.
    with pytest.raises(ValueError, match="no sampling stage"):
        ee.sgmcmc.cyclical_temperature(10, exploration=0.95)
    with pytest.raises(TypeError, match="exploration"):
        ee.sgmcmc.cyclical_temperature(10, exploration=lambda t: 0.5)
    with pytest.raises(TypeError, match="temperature"):
        ee.sgmcmc.cyclical_temperature(10, temperature=lambda t: 1.0)
    with pytest.raises(TypeError, match="friction"):
        ee.sgmcmc.sghmc(1e-3, num_data=10, friction=lambda t: 0.1)
    with pytest.raises(ValueError, match="do not fit"):
        ee.sgmcmc.sample_steps(10, 2, per_cycle=4, spacing=4)


def test_grouped_noise_is_each_leafs_own_normal_draw():
    """The small leaves' noise comes from ONE call of the threefry hash (each
    call site is ~100 operations XLA compiles anew) with the draws of
    `jax.random.normal(split(key, n)[i], shape)` for every leaf: the same
    bits op by op, and to the last bit compiled (XLA may evaluate the
    inverse error function's polynomial with fused multiply-adds in one
    fusion and not in another); a leaf over `GROUPED_DRAW_MAX` elements
    draws its own."""
    from eqx_ensemble import sgmcmc as sg

    shapes = [(64, 64), (64,), (3, 5, 7), (), (sg.GROUPED_DRAW_MAX + 1,), (10,)]

    def by_leaf(key):
        keys = jax.random.split(key, len(shapes))
        return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes)]

    def grouped(key):
        return sg._normals(jax.random.split(key, len(shapes)), shapes)

    key = jax.random.key(3)
    for got, want in zip(grouped(key), by_leaf(key), strict=True):
        np.testing.assert_array_equal(got, want)
    keys = jax.random.split(jax.random.key(5), 4)
    batched = jax.jit(jax.vmap(grouped))(keys)
    expected = jax.jit(jax.vmap(by_leaf))(keys)
    for got, want in zip(batched, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # The hash's call sites: one for the split, one for the five small
    # leaves, one for the large leaf; a call per leaf draws seven.
    calls = jax.jit(grouped).lower(key).as_text().count("call @threefry2x32")
    assert calls == 3, calls
    assert jax.jit(by_leaf).lower(key).as_text().count("call @threefry2x32") == 7


@pytest.mark.parametrize("sampler", [ee.sgmcmc.sgld, ee.sgmcmc.sghmc])
def test_a_schedule_that_goes_negative_is_named(sampler):
    # Below 0 the noise's scale is NaN: the run used to end as "members
    # diverged", far from the cause.
    ens = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 8, 1, key=k), size=2,
                      key=jax.random.key(0))  # fmt: skip
    x = jnp.linspace(-1, 1, 32)[:, None]

    def loss(model, batch, key):
        return jnp.mean((jax.vmap(model)(batch[0]) - batch[1]) ** 2)

    falling = optax.linear_schedule(1e-3, -2e-3, 30)  # negative from step 11
    with pytest.raises(Exception, match="schedule gave a negative value"):
        ee.fit(ens, loss, sampler(falling, num_data=32), (x, x), steps=30,
               batch_size=8, key=jax.random.key(1), callbacks=())  # fmt: skip
