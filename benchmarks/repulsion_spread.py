"""The members' spread beyond the data under weight-space SVGD and repulsion
(D'Angelo & Fortuin 2021) against a deep ensemble, over seeds: the numbers
behind the methods guide's claim.

1-D regression, 40 points of `sin(3x) + N(0, 0.1^2)` on [-1, 1]; 8 MLPs
1-32-32-1 (tanh); every method with the same Gaussian likelihood (sigma 0.1),
N(0, 1) prior, start, optimizer (Adam 1e-2, 500 full-batch steps) and seed;
the spread is the members' standard deviation at 2 <= |x| <= 3, the error
the ensemble mean's RMSE on the training points.

    python benchmarks/repulsion_spread.py [--seeds N]
"""

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_ensemble as ee

    n, sigma = 40, 0.1
    beyond = jnp.linspace(-3, 3, 24)[:, None]
    far = jnp.concatenate([jnp.linspace(-3, -2, 10), jnp.linspace(2, 3, 10)])[:, None]

    def loss(model, batch, key):
        xs, ys = batch
        weights = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
        prior = 0.5 * sum(jnp.sum(w**2) for w in weights)
        nll = jnp.mean((jax.vmap(model)(xs)[:, 0] - ys) ** 2) / (2 * sigma**2)
        return nll + prior / n

    methods = {
        "deep ensemble": loss,
        "SVGD (weights)": ee.svgd(loss, num_data=n),
        "repulsive (weights)": ee.repulsive(loss, num_data=n),
        "repulsive (functions)": ee.repulsive(
            loss, num_data=n, features=lambda m, b: jax.vmap(m)(beyond)
        ),
    }
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    for seed in range(args.seeds):
        kx, ky, k_init, k_fit = jax.random.split(jax.random.key(seed), 4)
        x = jax.random.uniform(kx, (n, 1), minval=-1, maxval=1)
        y = jnp.sin(3 * x[:, 0]) + sigma * jax.random.normal(ky, (n,))
        ens = ee.ensemble(
            lambda k: eqx.nn.MLP(1, 1, 32, 2, activation=jax.nn.tanh, key=k),
            size=8,
            key=k_init,
        )
        for name, objective in methods.items():
            run = ee.fit(ens, objective, optax.adam(1e-2), (x, y), steps=500,
                         batch_size=n, key=k_fit, callbacks=())  # fmt: skip
            inside = ee.predict(run.ensemble, x)[..., 0]
            spread = float(ee.predict(run.ensemble, far)[..., 0].std(0).mean())
            rmse = float(jnp.sqrt(jnp.mean((inside.mean(0) - y) ** 2)))
            rows[name].append((spread, rmse))
    print(f"{'method':<24}{'spread beyond, per seed':<28}RMSE on the data, per seed")
    for name, values in rows.items():
        spreads = " ".join(f"{s:.2f}" for s, _ in values)
        errors = " ".join(f"{e:.3f}" for _, e in values)
        print(f"{name:<24}{spreads:<28}{errors}")


if __name__ == "__main__":
    main()
