"""`ee.laplace` against laplace-torch (Daxberger et al. 2021) on the same trained
weights: scikit-learn's digits, an MLP 64-32-10 per member trained here, its
weights copied into PyTorch, last-layer Laplace with the GGN in three
structures. Prints, per member, the two libraries' log marginal likelihoods at a
fixed prior precision, the tuned prior precisions and the largest difference of
the probit predictive on held-out digits.

laplace-torch is not a dependency (it pulls a CUDA build of PyTorch); install it
beside the `loaders` extra's CPU PyTorch without its dependencies:

    pip install --target /tmp/lt --no-deps laplace-torch asdfghjkl \\
        backpack-for-pytorch curvlinops-for-pytorch einops torchmetrics \\
        lightning-utilities linear_operator unfoldNd einconv
    PYTHONPATH=/tmp/lt .venv/bin/python benchmarks/compare_laplace_torch.py
"""

import platform

import equinox as eqx
import jax
import numpy as np
import optax
import torch
from laplace import Laplace
from sklearn.datasets import load_digits

import eqx_ensemble as ee

MEMBERS = 3
STRUCTURES = {"kfac": "kron", "diagonal": "diag", "full": "full"}


def data():
    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    x = digits.data[order].astype(np.float32) / 16.0
    y = digits.target[order].astype(np.int32)
    return (x[:1000], y[:1000]), (x[1000:], y[1000:])


def train(train_data):
    ens = ee.ensemble(
        lambda k: eqx.nn.MLP(64, 10, 32, 1, key=k), size=MEMBERS, key=jax.random.key(0)
    )

    def loss(model, batch, key):
        logits = jax.vmap(model)(batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    return ee.fit(
        ens, loss, optax.adam(3e-3), train_data, steps=1500, batch_size=64,
        key=jax.random.key(1), callbacks=(),
    ).ensemble  # fmt: skip


def as_torch(model) -> torch.nn.Sequential:
    first, last = model.layers
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
    )
    with torch.no_grad():
        for layer, linear in ((net[0], first), (net[2], last)):
            layer.weight.copy_(torch.from_numpy(np.asarray(linear.weight)))
            layer.bias.copy_(torch.from_numpy(np.asarray(linear.bias)))
    return net.double()


def main() -> None:
    (x, y), (x_test, y_test) = data()
    ens = train((x, y))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(
            torch.from_numpy(x).double(), torch.from_numpy(y).long()
        ),
        batch_size=100,
    )
    print(
        f"machine: {platform.processor() or platform.machine()}; torch "
        f"{torch.__version__}; jax {jax.__version__}"
    )
    print(
        "structure  member  lml(ours)   lml(theirs)  prior(ours)  prior(theirs)  "
        "max |probit diff|"
    )
    for ours_name, theirs_name in STRUCTURES.items():
        ours = ee.laplace(
            ens,
            (x, y),
            likelihood="classification",
            prior_precision="marglik",
            curvature=ours_name,
        )
        fixed = ours.log_marginal_likelihood(1.0)
        ours_probs = np.asarray(ours.predict(x_test))
        for member in range(MEMBERS):
            la = Laplace(
                as_torch(ens[member]), "classification",
                subset_of_weights="last_layer", hessian_structure=theirs_name,
                prior_precision=1.0,
            )  # fmt: skip
            la.fit(loader)
            theirs_fixed = float(la.log_marginal_likelihood(torch.tensor(1.0)))
            la.optimize_prior_precision(
                method="marglik", pred_type="glm", link_approx="probit", n_steps=500,
                lr=0.1,
            )  # fmt: skip
            theirs_prior = float(la.prior_precision)
            # The predictive at OUR tuned prior, so the comparison is of the
            # predictive alone.
            la.prior_precision = float(ours.prior_precision[member])
            theirs_probs = (
                la(
                    torch.from_numpy(x_test).double(),
                    pred_type="glm",
                    link_approx="probit",
                )  # fmt: skip
                .detach()
                .numpy()
            )
            difference = np.abs(theirs_probs - ours_probs[member]).max()
            print(
                f"{ours_name:9}  {member:6}  {float(fixed[member]):10.3f}  "
                f"{theirs_fixed:11.3f}  {float(ours.prior_precision[member]):11.4f}  "
                f"{theirs_prior:13.4f}  {difference:.2e}"
            )


if __name__ == "__main__":
    main()
