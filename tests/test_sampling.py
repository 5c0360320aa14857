"""Samplings: the chunk precomputation gives exactly the per-step indices, and the
per-step indices follow the documented recipe (written here with `jax.random`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_ensemble as ee
from eqx_ensemble._core.data import (
    SORT_ALONE_FROM,
    _permutation_sorting_alone,
    _sorted_alone,
    permutation,
    rounds,
)
from eqx_ensemble._training.sampling import as_sampling


@pytest.mark.parametrize(
    "name", ["shared", "independent", "bootstrap", ee.Bootstrap(block_length=4)]
)
@pytest.mark.parametrize(
    "n, batch_size, chunk, first_step",
    [
        (64, 16, 10, 0),
        (64, 16, 10, 7),
        (50, 7, 13, 23),
        (256, 16, 100, 3),
        (10, 5, 4, 1),
    ],
)
def test_chunk_indices_match_per_step_indices(name, n, batch_size, chunk, first_step):
    _check_chunk_indices(name, n, batch_size, chunk, first_step)


@pytest.mark.parametrize("name", ["shared", "independent"])
def test_chunk_indices_of_large_epochs_match_per_step_indices(name):
    # Epochs large enough for a CPU's sort of keys alone (the samplings that
    # draw permutations), crossing from one epoch to the next.
    _check_chunk_indices(name, SORT_ALONE_FROM, SORT_ALONE_FROM // 4, 6, 2)


def _check_chunk_indices(name, n, batch_size, chunk, first_step):
    size = 3
    sampling = as_sampling(name)
    data_key, bootstrap_key = jax.random.split(jax.random.key(0))
    prepared = sampling.prepare(bootstrap_key, size, n)

    @jax.jit
    def planned(first):
        sample = sampling.chunk_indices(
            data_key,
            prepared,
            first,
            n=n,
            batch_size=batch_size,
            size=size,
            chunk=chunk,
        )
        return jax.lax.map(sample, first + jnp.arange(chunk, dtype=jnp.int32))

    got = np.asarray(planned(jnp.array(first_step, dtype=jnp.int32)))
    for offset in range(chunk):
        step = jnp.array(first_step + offset, dtype=jnp.int32)
        expected = sampling.indices(
            data_key, prepared, step, n=n, batch_size=batch_size, size=size
        )
        np.testing.assert_array_equal(got[offset], np.asarray(expected))


@pytest.mark.parametrize("n, step", [(20, 0), (20, 3), (20, 9), (SORT_ALONE_FROM, 5)])
def test_indices_follow_the_documented_recipe(n, step):
    batch_size, size = 4 * n // 20, 3
    data_key, bootstrap_key = jax.random.split(jax.random.key(1))
    per_epoch = n // batch_size
    order = jax.random.permutation(jax.random.fold_in(data_key, step // per_epoch), n)
    start = (step % per_epoch) * batch_size
    shared = ee.Shared().indices(
        data_key, None, jnp.int32(step), n=n, batch_size=batch_size, size=size
    )
    np.testing.assert_array_equal(shared, order[start : start + batch_size])
    independent = ee.Independent().indices(
        data_key, None, jnp.int32(step), n=n, batch_size=batch_size, size=size
    )
    for i, member_key in enumerate(jax.random.split(data_key, size)):
        member_order = jax.random.permutation(
            jax.random.fold_in(member_key, step // per_epoch), n
        )
        np.testing.assert_array_equal(
            independent[i], member_order[start : start + batch_size]
        )
    bootstrap = ee.Bootstrap()
    resamples = bootstrap.prepare(bootstrap_key, size, n)
    positions = jax.random.randint(
        jax.random.fold_in(data_key, step), (size, batch_size), 0, n
    )
    drawn = bootstrap.indices(
        data_key, resamples, jnp.int32(step), n=n, batch_size=batch_size, size=size
    )
    for i, resample_key in enumerate(jax.random.split(bootstrap_key, size)):
        resample = jax.random.randint(resample_key, (n,), 0, n)
        np.testing.assert_array_equal(drawn[i], resample[positions[i]])


@pytest.mark.parametrize("n", [SORT_ALONE_FROM - 1, SORT_ALONE_FROM, 70_000])
def test_permutation_is_jax_random_permutation_bit_for_bit(n):
    # On a CPU from `SORT_ALONE_FROM` indices on, the rounds sort their keys
    # alone; the result must be JAX's own permutation, under `vmap` too.
    keys = jax.random.split(jax.random.key(n), 3)
    ours = jax.jit(jax.vmap(lambda k: permutation(k, n)))(keys)
    for key, got in zip(keys, ours, strict=True):
        np.testing.assert_array_equal(got, jax.random.permutation(key, n))


def test_sorting_alone_takes_jaxs_rounds_below_the_threshold_too():
    # 1,024 indices shuffle in one round, 70,000 in two: the rounds come from
    # `rounds(n)`, not from the sizes the CPU path is chosen for.
    key = jax.random.key(3)
    np.testing.assert_array_equal(
        jax.jit(lambda k: _permutation_sorting_alone(k, 1024))(key),
        jax.random.permutation(key, 1024),
    )


def _sorts(jaxpr) -> int:
    """The `sort` operations of a jaxpr, in its inner jaxprs too."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "sort"
        for param in eqn.params.values():
            for inner in param if isinstance(param, tuple | list) else [param]:
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    count += _sorts(inner)
    return count


@pytest.mark.parametrize("n", [1024, 1625, 1626, 2_642_245, 2_642_246])
def test_permutation_sorts_as_many_rounds_as_jax(n):
    # JAX's round count changes at 1,626 and 2,642,246 indices; traced only.
    theirs = jax.make_jaxpr(lambda k: jax.random.permutation(k, n))(jax.random.key(0))
    assert rounds(n) == _sorts(theirs.jaxpr) > 0


@pytest.mark.parametrize("n", [1, 7, 600])
@pytest.mark.parametrize("distinct", [1, 3, 2**32])
def test_sorting_keys_alone_is_a_stable_sort_of_keys_and_values(n, distinct):
    # Few distinct keys make ties (runs of equal keys) of every length, which
    # random 32-bit keys make only rarely; values go where a stable sort of the
    # pairs puts them, also for rows of a `vmap` with other ties (its loop
    # runs until every row is placed).
    rng = np.random.default_rng(n + distinct)
    keys = rng.integers(0, distinct, (2, n), dtype=np.uint64).astype(np.uint32)
    keys[1] = rng.permutation(n)  # no ties in the second row
    values = jnp.asarray(rng.permutation(n).astype(np.int32) * 3 - 5)
    rows = jax.jit(jax.vmap(_sorted_alone, (0, None)))(jnp.asarray(keys), values)
    for row, row_keys in zip(rows, keys, strict=True):
        expected = np.asarray(values)[np.argsort(row_keys, kind="stable")]
        np.testing.assert_array_equal(row, expected)
        np.testing.assert_array_equal(
            jax.lax.sort_key_val(jnp.asarray(row_keys), values)[1], expected
        )


def test_in_bag_counts_rebuild_the_resamples():
    key, size, n = jax.random.key(7), 4, 30
    bootstrap_key = jax.random.split(key, 3)[1]
    counts = np.asarray(ee.Bootstrap().in_bag(key, size=size, num_examples=n))
    for i, resample_key in enumerate(jax.random.split(bootstrap_key, size)):
        resample = np.asarray(jax.random.randint(resample_key, (n,), 0, n))
        np.testing.assert_array_equal(counts[i], np.bincount(resample, minlength=n))
    assert counts.sum(axis=1).tolist() == [n] * size


def test_a_sampling_without_a_name_is_recorded_by_its_repr(tmp_path):
    """A user's sampling need not set `name`: a checkpointed run records its
    `repr` (and resuming with another sampling is refused by it)."""
    import equinox as eqx
    import optax

    class Every(ee.Sampling):
        per_member = False

        def indices(self, data_key, prepared, step, *, n, batch_size, size):
            return (step * batch_size + jnp.arange(batch_size)) % n

    ens = ee.ensemble(lambda k: eqx.nn.Linear(1, 1, key=k), size=2,
                      key=jax.random.key(0))  # fmt: skip
    x = jnp.linspace(0, 1, 16)[:, None]

    def loss(model, batch, key):
        return jnp.mean((jax.vmap(model)(batch) - 2 * batch) ** 2)

    def run(sampling, steps):
        return ee.fit(ens, loss, optax.sgd(0.1), x, steps=steps, batch_size=4,
                      key=jax.random.key(1), sampling=sampling,
                      checkpoints=ee.Checkpoints(tmp_path, every=2),
                      callbacks=())  # fmt: skip

    assert Every().record() == repr(Every())
    run(Every(), 2)
    with pytest.raises(Exception, match="different `sampling`"):
        run(ee.Shared(), 4)
