"""Peer libraries in PyTorch on the results page's classification splits
(issue 79): each trained on exactly the split arrays `results.py` gives its own
methods (`split["train"]`), with the same architecture and budget, and scored
by the same `results.score_classification`. Torch runs on the CPU with
`torch.set_num_threads(2)` (the machine's 2 cores; `threads=` changes it: a
batch of 64 through this MLP is too small to gain from a second thread, and
when another process holds a core, torch's 2 threads wait on each other at
every operation, measured here 25-40 times slower than 1 thread); versions via
`importlib.metadata` (`versions()`). Every draw (initialisation, batches,
dropout masks, MC dropout's 20 passes) comes from `seed`, under
`torch.random.fork_rng`: a row is the same on every run, and the global
generator is left as it was.

The common recipe (as `results.classification_methods`): an MLP of 2 hidden
layers of `results.WIDTH` = 128 ReLU units, Adam at 1e-3, `steps` steps of
`results.BATCH` = 64 examples, epochs of `n // 64` batches of a fresh
permutation (the last partial batch dropped, as `ee.fit`), drawn by a
`torch.Generator` seeded from `seed`; the weights start from PyTorch's default
`nn.Linear` initialisation (uniform in +-1/sqrt(fan_in), the same distribution
as `eqx.nn.Linear`'s).

Rows (`classification_rows`):

- "torch: deep ensemble (5)": 5 `nn.Sequential` MLPs, each trained alone on
  its own batches (as our `ee.Independent()` deep ensemble) by plain
  cross-entropy; the members' softmax probabilities. A reference for what the
  torch training itself gives, beside our "deep ensemble (5)".
- "laplace-torch: deep ensemble (5) + last-layer KFAC Laplace (marglik)":
  laplace-torch (Daxberger et al. 2021) on each of the same 5 trained members:
  `laplace.Laplace(model, "classification", subset_of_weights="last_layer",
  hessian_structure="kron")`, `.fit(loader)` on the training split,
  `.optimize_prior_precision(method="marglik", pred_type="glm",
  link_approx="probit")` (the library's defaults otherwise: a scalar prior
  precision, 100 Adam steps at 0.1 from 1.0), and the predictive
  `la(x, pred_type="glm", link_approx="probit")` per member: the mixture of
  the 5 predictives, `(5, batch, classes)`, as our "Laplace mixture (KFAC,
  marglik)". Its time is the ensemble's training plus the 5 Laplace fits and
  prior tunings (as ours: training plus `ee.laplace`).
- "TorchUncertainty: Packed-Ensembles (5, alpha 2)": TorchUncertainty's own
  packed MLP, `torch_uncertainty.models.mlp.packed_mlp(features, classes,
  [120, 120], num_estimators=5, alpha=2)` (its `PackedLinear` layers, the
  first `first=True`, reading the shared input through one dense group, the
  last `last=True`, returning `(5 * batch, classes)`, the middle one grouped
  in 5 blocks), trained by the recipe of TorchUncertainty's
  `ClassificationRoutine` for ensembles: the batch's targets repeated per
  estimator (`torch_uncertainty.transforms.batch.RepeatTarget(5)`) and the
  cross-entropy over the `(5 * batch, classes)` logits. The hidden width is
  120, not 128, exactly as our "Packed-Ensembles (5, alpha 2)" row: 128 * 2 =
  256 does not divide into 5 groups, 120 * 2 = 240 does (48 units per
  estimator); the two rows have the same parameter count.
- "TorchUncertainty: deep ensemble (5)": `torch_uncertainty.methods.
  deep_ensembles(mlp(features, classes, [128, 128]), num_estimators=5)` (5
  re-initialised copies in one module), trained as the routine trains
  ensembles: all members on the same batch (targets repeated, as above), where
  our deep ensemble and the torch row above give each member its own batches.
- "TorchUncertainty: MC dropout (1 x 20 passes)": `torch_uncertainty.methods.
  mc_dropout(mlp(features, classes, [128, 128], dropout_rate=0.1),
  num_estimators=20)`, trained as one network by cross-entropy, then 20
  stochastic passes (the wrapper keeps its dropout modules in training mode in
  `eval()`), as our "MC dropout (1 x 20 passes)" (p = 0.1 after each hidden
  layer; TorchUncertainty's MLP applies dropout before the ReLU, which for
  ReLU is the same function).

TorchUncertainty's package `__init__` (and those of its `models` and
`transforms` subpackages) import torchvision (plotting, image models and
corruptions); torchvision is not installed (the only wheel on this machine's
index is built for CUDA torch and fails against the CPU torch: "operator
torchvision::nms does not exist"). The modules used here need none of it: when
`import torch_uncertainty` fails, `_torch_uncertainty()` registers those three
packages as bare namespaces over the installed files, so that their
submodules (`layers.packed`, `models.mlp`, `methods`, `transforms.batch`) are
imported unchanged. `ClassificationRoutine` itself (a Lightning module in
`torch_uncertainty.routines`) imports torchvision, so its training step is
written out here (three lines: repeat the targets, the forward pass, the
cross-entropy) with the same optimiser and steps as every other row.

    python benchmarks/peers_torch.py             # digits and breast cancer, seed 0,
                                                 # 600 steps, beside ours
    python benchmarks/peers_torch.py --time      # train seconds at 2,000 steps
    ... --threads 1                              # on a machine shared with others
"""

import argparse
import importlib
import importlib.metadata
import importlib.util
import sys
import time
import types
import warnings
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import results
import torch
from torch import nn

MEMBERS, WIDTH, BATCH = results.MEMBERS, results.WIDTH, results.BATCH
PACKED_WIDTH, ALPHA = 120, 2  # as results.py's PackedMLP
DROPOUT, PASSES = 0.1, 20  # as results.py's DropoutMLP and its MC dropout row
THREADS = 1  # (see the module docstring: 2 threads only on an idle machine)

DEEP = f"torch: deep ensemble ({MEMBERS})"
LAPLACE = (
    f"laplace-torch: deep ensemble ({MEMBERS}) + last-layer KFAC Laplace (marglik)"
)
PACKED = f"TorchUncertainty: Packed-Ensembles ({MEMBERS}, alpha {ALPHA})"
TU_DEEP = f"TorchUncertainty: deep ensemble ({MEMBERS})"
TU_DROPOUT = f"TorchUncertainty: MC dropout (1 x {PASSES} passes)"

# Ours, for the sanity check: the rows the peers above stand beside.
OURS = {
    DEEP: f"deep ensemble ({MEMBERS})",
    LAPLACE: "Laplace mixture (KFAC, marglik)",
    PACKED: f"Packed-Ensembles ({MEMBERS}, alpha 2)",
    TU_DEEP: f"deep ensemble ({MEMBERS})",
    TU_DROPOUT: "MC dropout (1 x 20 passes)",
}


def versions() -> dict[str, str]:
    """The installed versions of the peers and of what they run on."""
    return {
        name: importlib.metadata.version(name)
        for name in ("torch", "laplace-torch", "torch-uncertainty", "lightning")
    }


def _torch_uncertainty() -> types.SimpleNamespace:
    """TorchUncertainty's packed MLP, plain MLP, `deep_ensembles`,
    `mc_dropout` and `RepeatTarget`, importable without torchvision (see the
    module docstring)."""
    try:
        importlib.import_module("torch_uncertainty")
    except ImportError:  # torchvision missing: bare packages, same files
        spec = importlib.util.find_spec("torch_uncertainty")
        root = list(spec.submodule_search_locations)[0]
        for name in ("", ".models", ".transforms"):
            package = types.ModuleType("torch_uncertainty" + name)
            package.__path__ = [root + name.replace(".", "/")]
            sys.modules["torch_uncertainty" + name] = package
    from torch_uncertainty.methods import deep_ensembles, mc_dropout
    from torch_uncertainty.models.mlp import mlp, packed_mlp
    from torch_uncertainty.transforms.batch import RepeatTarget

    return types.SimpleNamespace(
        mlp=mlp, packed_mlp=packed_mlp, deep_ensembles=deep_ensembles,
        mc_dropout=mc_dropout, RepeatTarget=RepeatTarget,
    )  # fmt: skip


def _tensors(split: dict) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = split["train"]
    return (
        torch.from_numpy(np.array(x, np.float32)),
        torch.from_numpy(np.array(y, np.int64)),
    )


def _batches(n: int, steps: int, generator: torch.Generator):
    """`steps` batches of indices: epochs of `n // BATCH` batches, each epoch a
    fresh permutation (as `ee.fit`'s sampling without replacement)."""
    per_epoch = n // BATCH
    order = None
    for step in range(steps):
        if step % per_epoch == 0:
            order = torch.randperm(n, generator=generator)
        start = (step % per_epoch) * BATCH
        yield order[start : start + BATCH]


def _train(model: nn.Module, loss_of, x, y, steps: int, seed: int) -> nn.Module:
    """Adam at 1e-3 for `steps` batches of 64 drawn with `seed` (and any
    dropout masks from the global generator seeded with it, restored after)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for index in _batches(len(y), steps, generator):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(model, x[index], y[index])
            loss.backward()
            optimizer.step()
    model.eval()
    return model


def _cross_entropy(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def _repeated_cross_entropy(repeat):
    """TorchUncertainty's routine for ensembles: targets repeated per estimator,
    the cross-entropy over the `(estimators * batch, classes)` logits."""

    def loss(model, x, y):
        inputs, targets = repeat((x, y))
        return nn.functional.cross_entropy(model(inputs), targets)

    return loss


def _mlp(features: int, classes: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(features, WIDTH), nn.ReLU(),
        nn.Linear(WIDTH, WIDTH), nn.ReLU(),
        nn.Linear(WIDTH, classes),
    )  # fmt: skip


def _count(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def _as_torch(x) -> torch.Tensor:
    return torch.from_numpy(np.array(x, np.float32))


def _members_first(logits: torch.Tensor, members: int) -> jnp.ndarray:
    """TorchUncertainty's `(members * batch, classes)` logits as probabilities
    `(members, batch, classes)`."""
    probs = torch.softmax(logits, dim=-1)
    return jnp.asarray(probs.reshape(members, -1, probs.shape[-1]).numpy())


def classification_rows(
    split: dict, seed: int, steps: int, *, threads: int = THREADS
) -> dict[str, tuple[Callable, int, float]]:
    """The peers' rows on one split: row name -> `(predict, parameters, train
    seconds)`, `predict(x)` the probabilities `(models, batch, classes)` (a
    `jnp.float32` array) of a float32 array `(batch, features)`, so that
    `results.score_classification(predict, split)` scores it unchanged.
    `threads`: `torch.set_num_threads` (2, the machine's cores; it stays set)."""
    from laplace import Laplace

    torch.set_num_threads(threads)
    tu = _torch_uncertainty()
    x, y = _tensors(split)
    features, classes = x.shape[1], split["classes"]
    out: dict[str, tuple[Callable, int, float]] = {}

    def timed(build):
        begin = time.perf_counter()
        value = build()
        return value, time.perf_counter() - begin

    def initialised(make, offset):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1000 * seed + offset)
            return make()

    # Plain torch deep ensemble: each member alone, its own batches.
    def deep():
        return [
            _train(initialised(lambda: _mlp(features, classes), m), _cross_entropy,
                   x, y, steps, 1000 * seed + m)
            for m in range(MEMBERS)
        ]  # fmt: skip

    members, deep_seconds = timed(deep)

    def deep_predict(inputs):
        with torch.no_grad():
            xs = _as_torch(inputs)
            return jnp.asarray(
                torch.stack([torch.softmax(m(xs), -1) for m in members]).numpy()
            )

    out[DEEP] = (deep_predict, _count(members), deep_seconds)

    # laplace-torch on each of those members.
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=256
    )

    def laplaces():
        fitted = []
        for model in members:
            la = Laplace(model, "classification", subset_of_weights="last_layer",
                         hessian_structure="kron")  # fmt: skip
            la.fit(loader)
            with warnings.catch_warnings():  # (a reminder to pass link_approx)
                warnings.filterwarnings("ignore", "By default `link_approx`")
                la.optimize_prior_precision(
                    method="marglik", pred_type="glm", link_approx="probit"
                )
            fitted.append(la)
        return fitted

    posteriors, laplace_seconds = timed(laplaces)

    def laplace_predict(inputs):
        xs = _as_torch(inputs)
        probs = [
            la(xs, pred_type="glm", link_approx="probit").detach() for la in posteriors
        ]
        return jnp.asarray(torch.stack(probs).numpy(), jnp.float32)

    out[LAPLACE] = (laplace_predict, _count(members), deep_seconds + laplace_seconds)

    # TorchUncertainty: Packed-Ensembles, its deep ensemble, its MC dropout.
    repeated = _repeated_cross_entropy(tu.RepeatTarget(MEMBERS))

    def implicit(model, count, offset, loss):
        trained, seconds = timed(
            lambda: _train(initialised(model, offset), loss, x, y, steps,
                           1000 * seed + offset)
        )  # fmt: skip

        def predict(inputs):
            # (MC dropout's masks: the same draws at every call, as our row's
            # fixed key; the other two are deterministic)
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(1000 * seed + offset + 1)
                return _members_first(trained(_as_torch(inputs)), count)

        return predict, _count([trained]), seconds

    out[PACKED] = implicit(
        lambda: tu.packed_mlp(features, classes, [PACKED_WIDTH, PACKED_WIDTH],
                              num_estimators=MEMBERS, alpha=ALPHA),
        MEMBERS, 100, repeated,
    )  # fmt: skip
    out[TU_DEEP] = implicit(
        lambda: tu.deep_ensembles(tu.mlp(features, classes, [WIDTH, WIDTH]),
                                  num_estimators=MEMBERS),
        MEMBERS, 200, repeated,
    )  # fmt: skip
    out[TU_DROPOUT] = implicit(
        lambda: tu.mc_dropout(
            tu.mlp(features, classes, [WIDTH, WIDTH], dropout_rate=DROPOUT),
            num_estimators=PASSES,
        ),
        PASSES, 300, _cross_entropy,
    )  # fmt: skip
    return out


# ------------------------------------------------------------ sanity check

COLUMNS = ("accuracy", "NLL", "ECE", "Brier", "APS size", "parameters", "train s")


def _line(name: str, scores: dict) -> str:
    ood = [v for k, v in scores.items() if k.startswith("AUROC")]
    cells = [f"{scores[c]:9.4g}" for c in COLUMNS]
    cells.append(f"{ood[0]:9.4g}" if ood else f"{'-':>9}")
    return f"{name[:68]:68} " + " ".join(cells)


def _header() -> str:
    return f"{'row':68} " + " ".join(f"{c[:9]:>9}" for c in (*COLUMNS, "AUROC"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--time", action="store_true",
        help="only the peers' train seconds at 2,000 steps (MNIST-5k included)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=THREADS)
    args = parser.parse_args(argv)
    print("versions:", versions())
    sets = results.classification_sets(with_mnist=True)
    if args.time:
        for name, data in sets.items():
            split = results.classification_split(data, args.seed)
            rows = classification_rows(split, args.seed, 2000, threads=args.threads)
            for row, (_, count, seconds) in rows.items():
                print(f"{name:14} {row:72} {count:8d} params {seconds:7.1f} s")
        return
    for name in ("digits", "breast cancer"):
        split = results.classification_split(sets[name], args.seed)
        print(f"\n{name}, seed {args.seed}, {args.steps} steps")
        print(_header())
        ours = results.classification_methods(split, args.seed, args.steps)
        peers = classification_rows(split, args.seed, args.steps, threads=args.threads)
        shown = set()
        for peer, (predict, count, seconds) in peers.items():
            mine = OURS[peer]
            if mine not in shown:
                shown.add(mine)
                predict_ours, count_ours, seconds_ours, *_ = ours[mine]
                scores, _ = results.score_classification(predict_ours, split)
                print(_line("ours: " + mine, {**scores, "parameters": count_ours,
                                              "train s": seconds_ours}))  # fmt: skip
            scores, probs = results.score_classification(predict, split)
            assert probs.dtype == jnp.float32 and probs.ndim == 3, probs.shape
            print(_line(peer, {**scores, "parameters": count, "train s": seconds}))


if __name__ == "__main__":
    main()
