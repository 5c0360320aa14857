"""Golden runs: the same fixed set of `fit` runs on two versions of the library,
compared leaf for leaf, bit for bit.

A restructuring (issue 25: the package's layout, `ee.Execution`, one data
source, one owner for a run) must not change a single bit of what a run
computes on a CPU. This script runs the fixed set below on a git revision (the
previous `main`, in a temporary worktree, with this environment's packages) and
on the working tree, in two fresh processes, and compares every array:

- MLP, shared batches; bootstrap batches; a stream (a step-indexed factory);
  independent batches from 16,384 examples (two epochs and a half)
- EMA + SWAG trackers
- PBT with evaluation
- checkpoints, then a resume from the checkpoint of step 30 to step 60
- a CNN on 8x8 images, with the plan 0.1 chose for it pinned (bit for bit), and
  with each version's own default plan (0.2 weighs the sequential layout and
  unrolling against the run's length: equal to float32 rounding)
- an ensemble with a shared, frozen part, and one with a trained shared part

Only the arguments both versions accept are used (no execution knobs: each
version's defaults). Usage:

    python benchmarks/golden.py --against main~1      # compare with a revision
    python benchmarks/golden.py --write out.npz       # one side only
"""

import argparse
import inspect
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _runs(workdir: pathlib.Path) -> dict[str, np.ndarray]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_ensemble as ee

    out: dict[str, np.ndarray] = {}
    new_api = "callbacks" in inspect.signature(ee.fit).parameters

    def fit(ens, loss_fn, optimizer, data, **kwargs):
        # The same runs through either version's keywords (0.2 moved some).
        kwargs.setdefault("progress", False)
        execution = kwargs.pop("execution", {})
        if new_api:
            if execution:
                kwargs["execution"] = ee.Execution(**execution)
            kwargs.pop("progress")
            kwargs["callbacks"] = kwargs.pop("controllers", [])
            if "hyperparams" in kwargs:
                kwargs["opt_state"] = ee.init_optimizer(
                    optimizer, ens, hyperparams=kwargs.pop("hyperparams")
                )
        else:
            kwargs.update(execution)
        return ee.fit(ens, loss_fn, optimizer, data, **kwargs)

    def keep(name: str, tree) -> None:
        leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]
        for path, leaf in leaves:
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            out[name + jax.tree_util.keystr(path)] = np.asarray(leaf)

    def result(name: str, res) -> None:
        keep(name + "/ensemble", res.ensemble)
        keep(name + "/opt_state", res.opt_state)
        out[name + "/losses"] = np.asarray(res.history.losses)
        out[name + "/eval_steps"] = np.asarray(res.history.eval_steps)
        out[name + "/eval_scores"] = np.asarray(res.history.eval_scores)
        out[name + "/diverged"] = np.asarray(sorted(res.diverged.items()))
        if res.tracked:
            keep(name + "/tracked", res.tracked)
        if res.best_ensemble is not None:
            keep(name + "/best", res.best_ensemble)

    x = jnp.linspace(-2, 2, 128)[:, None]
    y = x**3 + 0.1 * jnp.sin(7 * x)

    def mlp(key):
        return eqx.nn.MLP(1, 1, 32, 2, key=key)

    def loss(model, batch, key):
        xb, yb = batch
        return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)

    ens = ee.ensemble(mlp, size=4, key=jax.random.key(0))
    opt = optax.adam(1e-2)
    common = dict(steps=60, batch_size=16, key=jax.random.key(1))

    result("shared", fit(ens, loss, opt, (x, y), **common))
    result("bootstrap", fit(ens, loss, opt, (x, y), sampling="bootstrap", **common))
    # Epochs of 16,384 examples, one per member: a CPU sorts the permutations'
    # keys alone, which must give `jax.random.permutation`'s bits.
    big_x = jnp.linspace(-2, 2, 16384)[:, None]
    result(
        "independent 16384",
        fit(ens, loss, opt, (big_x, big_x**3), sampling="independent", steps=40,
            batch_size=1024, key=jax.random.key(1)),
    )  # fmt: skip

    def stream(step):
        rng = np.random.default_rng(0)
        batches = [rng.integers(0, 128, 16) for _ in range(60)]
        for indices in batches[step:]:
            yield np.asarray(x)[indices], np.asarray(y)[indices]

    result(
        "stream",
        fit(ens, loss, opt, stream, steps=60, key=jax.random.key(1)),
    )
    result(
        "trackers",
        fit(
            ens,
            loss,
            opt,
            (x, y),
            track=[ee.EMA(decay=0.9), ee.SWAG(start=20, every=5, rank=3)],
            **common,
        ),
    )
    hopt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    result(
        "pbt",
        fit(
            ens,
            loss,
            hopt,
            (x, y),
            hyperparams={"learning_rate": jnp.array([1e-3, 3e-3, 1e-2, 3e-2])},
            evaluate=ee.Evaluate(loss, (x, y), every=10),
            controllers=[
                ee.PBT(every=20, fraction=0.25, hyperparams=("learning_rate",))
            ],
            **common,
        ),
    )

    directory = workdir / "checkpoints"
    first = fit(
        ens,
        loss,
        opt,
        (x, y),
        checkpoints=ee.Checkpoints(directory, every=10),
        **dict(common, steps=30),
    )
    result("checkpointed", first)
    resumed = fit(
        ens,
        loss,
        opt,
        (x, y),
        checkpoints=ee.Checkpoints(directory, every=10),
        **common,
    )
    result("resumed", resumed)

    images = jax.random.normal(jax.random.key(2), (64, 1, 8, 8))
    labels = jax.random.randint(jax.random.key(3), (64,), 0, 4)

    class CNN(eqx.Module):
        conv: eqx.nn.Conv2d
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.conv = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1)
            self.head = eqx.nn.Linear(4 * 8 * 8, 4, key=k2)

        def __call__(self, image):
            return self.head(jax.nn.relu(self.conv(image)).ravel())

    def cnn_loss(model, batch, key):
        xb, yb = batch
        logits = jax.vmap(model)(xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    cnns = ee.ensemble(CNN, size=3, key=jax.random.key(4))
    # The CPU plan 0.1 chose for a short CNN run (0.2 weighs the sequential
    # layout and unrolled steps against the run's length), pinned: bit for bit.
    result(
        "cnn",
        fit(
            cnns,
            cnn_loss,
            optax.adam(1e-3),
            (images, labels),
            execution=dict(unroll=True, layout="sequential", steps_per_dispatch=3),
            **dict(common, steps=20),
        ),
    )
    # Each version's own default plan: equal to rounding (ROUNDING below).
    result(
        "cnn_default",
        fit(
            cnns, cnn_loss, optax.adam(1e-3), (images, labels), **dict(common, steps=20)
        ),
    )

    for name, train_shared in (("shared_frozen", False), ("shared_trained", True)):
        heads = ee.ensemble(
            mlp,
            size=4,
            key=jax.random.key(5),
            shared=lambda m: m.layers[0],
            train_shared=train_shared,
        )
        result(name, fit(heads, loss, opt, (x, y), **common))
    return out


def write(path: str) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        arrays = _runs(pathlib.Path(workdir))
    np.savez(path, **arrays)
    print(f"wrote {len(arrays)} arrays to {path}")


# Runs whose default plan changed on purpose: compared to float32 rounding.
ROUNDING = {"cnn_default": dict(rtol=1e-4, atol=1e-5)}


def compare(old_path: str, new_path: str) -> bool:
    old, new = np.load(old_path), np.load(new_path)
    missing = sorted(set(old.files) ^ set(new.files))
    different = []
    for name in sorted(set(old.files) & set(new.files)):
        a, b = old[name], new[name]
        tolerance = ROUNDING.get(name.split("/")[0])
        if a.dtype != b.dtype or a.shape != b.shape:
            different.append(name)
        elif tolerance is not None:
            if not np.allclose(a, b, equal_nan=True, **tolerance):
                different.append(name)
        elif a.tobytes() != b.tobytes():
            different.append(name)
    for run, tolerance in ROUNDING.items():
        deltas = [
            float(np.max(np.abs(old[n].astype(float) - new[n].astype(float))))
            for n in old.files
            if n.startswith(run + "/") and n in new.files and old[n].size
        ]
        print(
            f"{run}: compared to rounding ({tolerance}); largest difference "
            f"{max(deltas, default=0.0):.3g}"
        )
    runs = sorted({name.split("/")[0] for name in old.files})
    print(f"{len(old.files)} arrays in {len(runs)} runs: {', '.join(runs)}")
    for name in missing:
        print(f"  only on one side: {name}")
    for name in different:
        delta = np.max(np.abs(old[name].astype(float) - new[name].astype(float)))
        print(f"  DIFFERENT: {name} (max abs difference {delta:.3g})")
    same = not missing and not different
    print("every other array bit-identical" if same else "NOT identical")
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="a git revision to compare with")
    parser.add_argument("--write", help="write this version's arrays to a .npz")
    args = parser.parse_args()
    if args.write:
        write(args.write)
        return
    revision = args.against or "HEAD"
    with tempfile.TemporaryDirectory() as scratch:
        tree = pathlib.Path(scratch) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), revision],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            sides = {}
            for side, source in (("old", tree), ("new", ROOT)):
                sides[side] = str(pathlib.Path(scratch) / f"{side}.npz")
                env = dict(os.environ, PYTHONPATH=str(source))
                subprocess.run(
                    [sys.executable, __file__, "--write", sides[side]],
                    env=env,
                    check=True,
                    cwd=scratch,
                )
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT
            )
            shutil.rmtree(tree, ignore_errors=True)
        print(f"old: {revision}; new: the working tree")
        sys.exit(0 if compare(sides["old"], sides["new"]) else 1)


if __name__ == "__main__":
    main()
