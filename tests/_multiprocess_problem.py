"""The training problem shared by the multi-process workers and their reference."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_ensemble as ee

MEMBERS = 4
NUM_EXAMPLES = 64
STEPS = 12


def make_problem():
    x = jnp.linspace(-1.0, 1.0, NUM_EXAMPLES, dtype=jnp.float32)[:, None]
    y = jnp.sin(3.0 * x)
    ens = ee.ensemble(
        lambda key: eqx.nn.MLP(1, 1, 8, 1, key=key), size=MEMBERS, key=jax.random.key(0)
    )
    return ens, (x, y)


def loss_fn(model, batch, key):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def train(ens, data, mesh, *, steps=STEPS, checkpoints=None, callbacks=()):
    return ee.fit(
        ens,
        loss_fn,
        optax.adam(1e-2),
        data,
        steps=steps,
        checkpoints=checkpoints,
        batch_size=16,
        key=jax.random.key(1),
        sampling="independent",
        callbacks=callbacks,
        execution=ee.Execution(steps_per_dispatch=5, mesh=mesh),
    )
