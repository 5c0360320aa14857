"""The per-chunk sampler gives exactly the indices of `_data.batch_indices`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_ensemble._chunk_plan import chunk_sampler, epochs_spanned
from eqx_ensemble._data import batch_indices, bootstrap_resamples


@pytest.mark.parametrize("sampling", ["shared", "independent", "bootstrap"])
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
def test_chunk_sampler_matches_per_step_indices(
    sampling, n, batch_size, chunk, first_step
):
    size = 3
    data_key, bootstrap_key = jax.random.split(jax.random.key(0))
    resamples = (
        bootstrap_resamples(bootstrap_key, size, n) if sampling == "bootstrap" else None
    )

    @jax.jit
    def planned(first):
        sample = chunk_sampler(
            sampling,
            data_key,
            resamples,
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
        expected = batch_indices(
            sampling,
            data_key,
            resamples,
            step,
            n=n,
            batch_size=batch_size,
            size=size,
        )
        np.testing.assert_array_equal(got[offset], np.asarray(expected))


def test_epochs_spanned_covers_every_window():
    for steps_per_epoch in range(1, 9):
        for chunk in range(1, 20):
            worst = max(
                (start + chunk - 1) // steps_per_epoch - start // steps_per_epoch + 1
                for start in range(3 * steps_per_epoch)
            )
            assert epochs_spanned(chunk, steps_per_epoch) >= worst
