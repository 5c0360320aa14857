"""Worker for tests/test_resume.py: trains with checkpoints, optionally killing
itself (SIGKILL, no cleanup) once a given step's checkpoint exists."""

import os
import signal
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_ensemble as ee


def problem():
    x = jnp.linspace(-2.0, 2.0, 96)[:, None]
    y = jnp.sin(2.0 * x)
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(1, 1, 16, 2, key=k), size=3, key=jax.random.key(0)
    )

    def loss_fn(model, batch, key):
        xb, yb = batch
        return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)

    return ens, loss_fn, optax.adam(3e-3), (x, y)


def train(checkpoint_dir, kill_at=None, steps=200, sampling="bootstrap"):
    ens, loss_fn, optimizer, data = problem()

    def callback(result):
        if kill_at is not None and result.step >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    return ee.fit(
        ens,
        loss_fn,
        optimizer,
        data,
        steps=steps,
        batch_size=16,
        key=jax.random.key(42),
        sampling=sampling,
        checkpoints=ee.Checkpoints(checkpoint_dir, every=40),
        callbacks=[callback],
        execution=ee.Execution(steps_per_dispatch=30),
    )


if __name__ == "__main__":
    directory, kill_at, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    result = train(directory, kill_at=kill_at if kill_at >= 0 else None)
    leaves = [
        np.asarray(x)
        for x in jax.tree.leaves(eqx.filter(result.ensemble, eqx.is_array))
    ]
    np.savez(out, *leaves, losses=result.history.losses)
