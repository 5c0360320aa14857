"""Peer libraries on the tabular rows of the results page (issue 79): MAPIE
(conformal prediction, scikit-learn-contrib) and TabM (Gorishniy et al. 2024,
"TabM: Advancing Tabular Deep Learning with Parameter-Efficient Ensembling",
ICLR 2025), on the same splits and scored by the same functions as
`results.py`. Versions: `versions()` reads them with `importlib.metadata`
(written against MAPIE 1.6.0, tabm 0.0.3, torch 2.13.0+cpu, scikit-learn
1.9.1).

    python benchmarks/peers_tabular.py             # sanity run: split/seed 0
    python benchmarks/peers_tabular.py --quick     # the same at a toy size

MAPIE on OUR ensemble's predictions (the conformal step alone, against
`results.conformal_regression` and the APS/RAPS columns of
`results.score_classification`):

- `mapie_regression(means, variances, y, seed)`: the cross-fitted halves of
  `conformal_regression` (the same permutation from `seed`; calibrate on one
  half, score the other, both ways, average). The "estimator" is a prefit
  wrapper whose inputs ARE the ensemble's predictions (column 0 the mixture's
  mean, column 1 its standard deviation, given by `predict(X,
  return_std=True)`), so MAPIE sees exactly the numbers ours does.
  Split: `mapie.regression.SplitConformalRegressor(prefit=True,
  confidence_level=0.9, conformity_score=StdConformityScore())` (MAPIE's
  `|y - y_pred| / y_std` score; `ResidualNormalisedScore` is a different
  thing: it fits a second model of the residuals). CQR:
  `mapie.regression.ConformalizedQuantileRegressor(prefit=True)` with three
  prefit "quantile regressors" returning our Gaussian 5% and 95% bounds and
  the mean, `predict_interval(symmetric_correction=True)` (one constant for
  both bounds, as Romano et al. and `ee.conformal.cqr`; MAPIE's default is
  two one-sided constants at alpha / 2 each).
  Quantile conventions: both libraries take the `ceil((n + 1)(1 - alpha))`-th
  smallest score for CQR and for the upper side of the split interval, so
  those agree to rounding. MAPIE's split interval with a symmetric score
  takes its LOWER side from a reversed quantile, the
  `ceil(alpha (n + 1))`-th LARGEST score, one rank below the upper side's
  whenever `alpha (n + 1)` is not a whole number (n = 25: the 23rd smallest
  below, the 24th above); the interval is then slightly narrower below than
  ours, `mean - q_23 std .. mean + q_24 std` against `mean -+ q_24 std`.
- `mapie_classification(val_probs, val_y, test_probs, test_y)`:
  `mapie.classification.SplitConformalClassifier(prefit=True,
  confidence_level=0.9, conformity_score="aps" | "raps")` on a prefit
  wrapper whose inputs ARE the ensemble's mean probabilities.
  Randomization: ours (`ee.conformal.aps` / `raps` in `score_classification`)
  is randomized (a uniform tie-break per example, coverage near 90%, empty
  sets possible). MAPIE's calibration scores are always randomized
  (`cumsum - u * p_true`); its sets are randomized only with
  `include_last_label="randomized"` (the default `True` keeps the crossing
  label: conservative, never empty). `"randomized"` is the matching setting
  and is used. The uniforms differ (MAPIE draws from NumPy with
  `random_state`, ours from fixed JAX keys), so the two agree in
  distribution, not draw by draw.
  RAPS differs by design: ours fixes `penalty = 0.01, k_reg = 1`; MAPIE's
  `RAPSConformityScore` holds out 20% of the calibration set (stratified) to
  choose `k_reg` (the 90% quantile of the true label's rank, + 1) and `lambda`
  (the smallest mean set size over {0.001, 0.01, 0.1, 0.2, 0.5}), as in
  Angelopoulos et al. 2021, and calibrates on the other 80%.

MAPIE on its own:

- `mapie_own_regression(train, test, scale, seed, epochs)`: scikit-learn's
  `MLPRegressor` with the recipe's network and budget (one hidden layer of
  50 ReLU units, Adam 0.01, batch 100, `epochs` passes, no L2 (`alpha=0`), no
  early stopping), inside MAPIE's two documented regressors, both at 90%:
  "MAPIE split (MLP)": `SplitConformalRegressor(prefit=False)`, the MLP
  fitted on 80% of the training split and conformalized on the other 20%
  (MAPIE's documented train / conformalize split, carved from our training
  split; absolute residuals). "MAPIE CV+ (MLP, 5 folds)":
  `CrossConformalRegressor(method="plus", cv=KFold(5, shuffle))`, five MLPs
  on the folds (and one on all of it, MAPIE's single estimator), absolute
  out-of-fold residuals, the point prediction the folds' mean. The network
  predicts a mean only (scikit-learn's MLP has no Gaussian NLL), so these
  rows have an RMSE and conformal intervals but no NLL. Targets are
  standardised on the training split as ours; scores are in the targets'
  units.

TabM:

- `tabm_regression(train, x_test, seed, epochs)`: `tabm.TabM.make(
  n_num_features=features, d_out=2, k=32)`, i.e. the package's defaults:
  `arch_type="tabm"` (BatchEnsemble linear layers with TabM's
  initialisation: random-sign first adapters, ones after), 3 blocks of 512
  ReLU units, dropout 0.1, no numerical embeddings. Each of the k heads
  predicts a mean and a variance (softplus + 1e-6, as our recipe) and is
  trained with the Gaussian NLL, the mean over heads and batch ("each of the
  k predictions trained separately" on shared batches, as TabM's example
  trains its MSE); the k heads are the members, so the predictive is the
  same moment-matched mixture as our rows and the same NLL, coverage and
  conformal scores apply. (Its default MSE loss with the heads' spread as
  the variance was rejected: the heads share almost every weight and see the
  same batches, so their spread is a small epistemic term with no aleatoric
  noise, and the NLL of such a row measures that mismatch, not TabM.)
  Budget: the recipe's batch 100 and 40 epochs (no validation split, so no
  early stopping). TabM's optimizer where it matters for its 3 x 512
  backbone: AdamW lr 2e-3, weight decay 3e-4, gradient clipping at norm 1
  (the package example's settings; the recipe's Adam 0.01 is tuned for 50
  units). Returns the standardised units of `regression_split`, `(k, batch)`.
- `tabm_regression(..., **TABM_RECIPE)`: the same TabM model class and loss
  with the recipe's network and optimizer, for a like-for-like row: k = 32
  heads on ONE shared hidden layer of 50 units (`n_blocks=1, d_block=50`,
  no dropout; BatchEnsemble adapters on its input and output, a separate
  output layer per head), Adam 0.01 (AdamW without weight decay), no
  clipping. Its difference from our 5-member deep ensemble is TabM's
  weight sharing and its 32 heads.

Times: wall seconds of the training alone, on this machine's CPU. TabM runs
with ONE PyTorch thread by default (`threads=1`, restored after the call):
on this 2-core machine shared with other jobs, two threads made a 3 x 512
step about 4x slower (1.16 s against 0.30 s at batch 100 x k 32). The
MAPIE-on-our-predictions rows have no training (their seconds are the
calibration).
"""

import argparse
import importlib.metadata
import math
import time
import warnings
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin

ALPHA = 0.1  # results.CONFORMAL_ALPHA: 90% intervals and sets
CONFIDENCE = 0.9
TABM_DEFAULTS = dict(k=32, n_blocks=3, d_block=512, dropout=0.1)
# `tabm_regression(..., **TABM_RECIPE)`: the recipe's network and optimizer
# as a TabM (k = 32 heads on one shared hidden layer of 50, no dropout, Adam
# 0.01 without weight decay or clipping).
TABM_RECIPE = dict(
    n_blocks=1, d_block=50, dropout=0.0, lr=0.01, weight_decay=0.0, clip=None
)


def versions() -> dict[str, str]:
    """The peer packages' installed versions."""
    names = ("mapie", "tabm", "torch", "scikit-learn", "rtdl_num_embeddings")
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


# ------------------------------------------------- MAPIE on our predictions


class _GivenRegression(RegressorMixin, BaseEstimator):
    """A "fitted" regressor whose inputs are the predictions themselves:
    `predict(X)` is `X[:, column]`; with `return_std=True`, `(X[:, 0], X[:,
    1])` (MAPIE's `StdConformityScore` asks for that)."""

    def __init__(self, column: int = 0):
        self.column = column

    def fit(self, X=None, y=None):
        self.fitted_ = True  # what MAPIE's prefit check looks for
        return self

    def predict(self, X, return_std: bool = False):
        X = np.asarray(X, np.float64)
        if return_std:
            return X[:, 0], X[:, 1]
        return X[:, self.column]


class _GivenProbabilities(ClassifierMixin, BaseEstimator):
    """A "fitted" classifier whose inputs are the probabilities themselves."""

    def __init__(self, classes: int = 2):
        self.classes = classes

    def fit(self, X=None, y=None):
        self.classes_ = np.arange(self.classes)
        return self

    def predict_proba(self, X):
        return np.asarray(X, np.float64)

    def predict(self, X):
        return np.argmax(np.asarray(X), axis=1)


def _mixture(means, variances) -> tuple[np.ndarray, np.ndarray]:
    """The members' moment-matched Gaussian mixture (mean, std), float64."""
    means = np.asarray(means, np.float64)
    variances = np.asarray(variances, np.float64)
    mean = means.mean(0)
    variance = (variances + means**2).mean(0) - mean**2
    return mean, np.sqrt(np.maximum(variance, np.finfo(np.float32).tiny))


def mapie_regression(means, variances, y, seed) -> dict[str, float]:
    """MAPIE 1.6's split conformal (`StdConformityScore`: `|y - mean| / std`)
    and CQR (prefit bounds: the mixture's Gaussian 5% and 95% quantiles,
    symmetric correction) at 90% on our ensemble's predictions `(members,
    batch)`, cross-fitted on the halves of `results.conformal_regression`;
    the same keys."""
    from mapie.conformity_scores import StdConformityScore
    from mapie.regression import (
        ConformalizedQuantileRegressor,
        SplitConformalRegressor,
    )
    from scipy.special import ndtri

    y = np.asarray(y, np.float64)
    order = np.random.default_rng(seed).permutation(len(y))
    halves = (order[: len(y) // 2], order[len(y) // 2 :])
    mean, std = _mixture(means, variances)
    z = float(ndtri(1 - ALPHA / 2))
    split_x = np.column_stack([mean, std])
    cqr_x = np.column_stack([mean - z * std, mean + z * std, mean])
    found: dict[str, list[float]] = {}
    for calibrate, score in (halves, halves[::-1]):
        split = SplitConformalRegressor(
            _GivenRegression().fit(),
            confidence_level=CONFIDENCE,
            conformity_score=StdConformityScore(),
            prefit=True,
        ).conformalize(split_x[calibrate], y[calibrate])
        _, split_bounds = split.predict_interval(split_x[score])
        bounds = [_GivenRegression(column).fit() for column in (0, 1, 2)]
        cqr = ConformalizedQuantileRegressor(
            bounds, confidence_level=CONFIDENCE, prefit=True
        ).conformalize(cqr_x[calibrate], y[calibrate])
        with warnings.catch_warnings():  # bounds pulled in past the median
            warnings.simplefilter("ignore", UserWarning)
            _, cqr_bounds = cqr.predict_interval(
                cqr_x[score], symmetric_correction=True
            )
        for name, interval in (("split", split_bounds), ("CQR", cqr_bounds)):
            low, high = interval[:, 0, 0], interval[:, 1, 0]
            covered = (low <= y[score]) & (y[score] <= high)
            found.setdefault(f"{name} 90% coverage", []).append(float(covered.mean()))
            found.setdefault(f"{name} 90% width", []).append(float((high - low).mean()))
    return {column: float(np.mean(values)) for column, values in found.items()}


MAPIE_BINARY = (
    "MAPIE 1.6 refuses APS and RAPS on a binary target (its `check_target`: "
    '"Invalid conformity score for binary target. The only valid score is '
    "'lac'.\")"
)


def _mean_probabilities(probs) -> np.ndarray:
    probs = np.asarray(probs, np.float64)
    if probs.ndim == 3:  # (models, batch, classes): the ensemble's mean
        probs = probs.mean(0)
    return probs / probs.sum(-1, keepdims=True)


def mapie_classification(
    val_probs, val_y, test_probs, test_y, random_state: Any = 17
) -> dict[str, float]:
    """MAPIE 1.6's split conformal sets at 90% with the APS and RAPS scores,
    calibrated on the validation split and scored on the test split, from our
    ensemble's mean probabilities (`(models, batch, classes)` or `(batch,
    classes)`); randomized sets (`include_last_label="randomized"`), as ours.
    Keys: "APS coverage", "APS size", "RAPS coverage", "RAPS size"; none for
    two classes (`MAPIE_BINARY` says why)."""
    from mapie.classification import SplitConformalClassifier

    val, test = _mean_probabilities(val_probs), _mean_probabilities(test_probs)
    val_y, test_y = np.asarray(val_y), np.asarray(test_y)
    if val.shape[1] == 2:
        return {}  # MAPIE_BINARY: the page says why
    scores = {}
    for kind in ("aps", "raps"):
        mapie = SplitConformalClassifier(
            _GivenProbabilities(val.shape[1]).fit(),
            confidence_level=CONFIDENCE,
            conformity_score=kind,
            prefit=True,
            random_state=random_state,
        ).conformalize(val, val_y)
        _, sets = mapie.predict_set(
            test, conformity_score_params={"include_last_label": "randomized"}
        )
        sets = sets[:, :, 0]
        picked = sets[np.arange(len(test_y)), test_y]
        scores[f"{kind.upper()} coverage"] = float(picked.mean())
        scores[f"{kind.upper()} size"] = float(sets.sum(1).mean())
    return scores


# ------------------------------------------------------- MAPIE on its own


def _mlp(seed: int, epochs: int):
    from sklearn.neural_network import MLPRegressor

    return MLPRegressor(
        hidden_layer_sizes=(50,),
        activation="relu",
        solver="adam",
        learning_rate_init=0.01,
        batch_size=100,
        max_iter=epochs,
        n_iter_no_change=epochs + 1,  # no early stop on the training loss
        alpha=0.0,
        random_state=seed,
    )


def _mlp_parameters(features: int) -> int:
    """The 1 x 50 network's weights and biases (mean output only)."""
    return (features + 1) * 50 + 51


def mapie_own_regression(
    train, test, scale, seed: int, epochs: int = 40
) -> dict[str, dict[str, float]]:
    """Two rows of MAPIE 1.6 wrapping scikit-learn's `MLPRegressor` (the
    recipe's 1 x 50 network and budget, MSE) on `regression_split`'s output:
    `train` (standardised), `test = (x_test, y_test)` with `y_test` in the
    targets' units, `scale = (y_mean, y_std)`. Row -> {"RMSE", "90% coverage",
    "90% width", "train s", "parameters"}, in the targets' units."""
    from mapie.regression import CrossConformalRegressor, SplitConformalRegressor
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.model_selection import KFold, train_test_split

    x_train, y_train = (np.asarray(a, np.float64) for a in train)
    x_test, y_test = np.asarray(test[0], np.float64), np.asarray(test[1])
    y_mean, y_std = (float(v) for v in scale)
    rows: dict[str, dict[str, float]] = {}

    def score(name, points, intervals, seconds, parameters):
        points = points * y_std + y_mean
        low = intervals[:, 0, 0] * y_std + y_mean
        high = intervals[:, 1, 0] * y_std + y_mean
        rows[name] = {
            "RMSE": float(np.sqrt(np.mean((points - y_test) ** 2))),
            "90% coverage": float(((low <= y_test) & (y_test <= high)).mean()),
            "90% width": float((high - low).mean()),
            "train s": seconds,
            "parameters": float(parameters),
        }

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        fit_x, cal_x, fit_y, cal_y = train_test_split(
            x_train, y_train, test_size=0.2, random_state=seed
        )
        begin = time.perf_counter()
        split = SplitConformalRegressor(
            _mlp(seed, epochs), confidence_level=CONFIDENCE, prefit=False
        )
        split.fit(fit_x, fit_y).conformalize(cal_x, cal_y)
        seconds = time.perf_counter() - begin
        points, intervals = split.predict_interval(x_test)
        count = _mlp_parameters(x_train.shape[1])
        score("MAPIE split (MLP)", points, intervals, seconds, count)

        begin = time.perf_counter()
        cv = CrossConformalRegressor(
            _mlp(seed, epochs),
            confidence_level=CONFIDENCE,
            method="plus",
            cv=KFold(5, shuffle=True, random_state=seed),
            random_state=seed,
        ).fit_conformalize(x_train, y_train)
        seconds = time.perf_counter() - begin
        points, intervals = cv.predict_interval(
            x_test, aggregate_point_predictions="mean"
        )
        count = 5 * _mlp_parameters(x_train.shape[1])  # the folds' models predict
        score("MAPIE CV+ (MLP, 5 folds)", points, intervals, seconds, count)
    return rows


# ------------------------------------------------------------------- TabM


def tabm_regression(
    train,
    x_test,
    seed: int,
    epochs: int = 40,
    *,
    batch_size: int = 100,
    lr: float = 2e-3,
    weight_decay: float = 3e-4,
    clip: float | None = 1.0,
    threads: int | None = 1,
    **model: Any,
) -> tuple[np.ndarray, np.ndarray, int, float]:
    """TabM (the `tabm` package's `TabM.make`, its defaults unless `model`
    overrides them: `k`, `n_blocks`, `d_block`, `dropout`, ...) trained with
    the per-head Gaussian NLL on `train` (standardised, from
    `regression_split`) with AdamW; returns `(means, variances, parameters,
    train_seconds)`, the k heads' predictions on `x_test`, `(k, batch)`, in
    the STANDARDISED units. `threads`: PyTorch's intra-op threads for the
    call (restored after; None leaves them)."""
    import tabm
    import torch

    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        x = torch.as_tensor(np.asarray(train[0]), dtype=torch.float32)
        y = torch.as_tensor(np.asarray(train[1]), dtype=torch.float32)
        net = tabm.TabM.make(
            n_num_features=x.shape[1], d_out=2, **(TABM_DEFAULTS | model)
        )
        optimizer = torch.optim.AdamW(
            net.parameters(), lr=lr, weight_decay=weight_decay
        )

        def heads(xs):
            out = net(xs)  # (batch, k, 2)
            return out[..., 0], torch.nn.functional.softplus(out[..., 1]) + 1e-6

        begin = time.perf_counter()
        net.train()
        for _ in range(epochs):
            for index in torch.randperm(len(y), generator=generator).split(batch_size):
                mean, variance = heads(x[index])
                target = y[index, None]  # every head on the same batch
                loss = torch.mean(
                    0.5 * torch.log(variance) + 0.5 * (target - mean) ** 2 / variance
                )
                optimizer.zero_grad()
                loss.backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
                optimizer.step()
        seconds = time.perf_counter() - begin
        net.eval()
        with torch.inference_mode():
            mean, variance = heads(
                torch.as_tensor(np.asarray(x_test), dtype=torch.float32)
            )
        parameters = sum(p.numel() for p in net.parameters())
    finally:
        torch.set_num_threads(previous)
    return mean.T.numpy(), variance.T.numpy(), int(parameters), seconds


# ------------------------------------------------------------ sanity run


def _our_regression(x, y, split, epochs):
    """The recipe row of `run_regression` on one split: means and variances
    in the targets' units, and its train seconds."""
    import jax
    import optax
    import results

    import eqx_ensemble as ee

    train, (x_test, y_test), (y_mean, y_std) = results.regression_split(x, y, split)
    epsilon = 0.01 * (train[0].max(0) - train[0].min(0))
    steps = epochs * math.ceil(len(train[1]) / 100)
    ens = ee.ensemble(
        results.gaussian_head(x.shape[1]), size=5, key=jax.random.key(split)
    )
    run, seconds = results.timed(
        lambda: ee.fit(
            ens, ee.adversarial(results.gaussian_nll_loss, epsilon=epsilon),
            optax.adam(0.01), train, steps=steps, batch_size=100,
            key=jax.random.key(1000 + split), sampling=ee.Independent(), callbacks=(),
        )
    )  # fmt: skip
    means, variances = ee.map(results.mean_variance, run.ensemble, x_test)
    return means * y_std + y_mean, variances * y_std**2, seconds


def _regression_scores(means, variances, y_test) -> dict[str, float]:
    import jax.numpy as jnp
    import results

    M = results.M
    means, variances = jnp.asarray(means), jnp.asarray(variances)
    return {
        "RMSE": float(M.rmse(means, y_test)),
        "NLL": float(M.gaussian_nll(means, variances, y_test)),
        "95% coverage": float(M.interval_coverage(means, variances, y_test)),
        "95% width": results.interval_width(means, variances),
    }


def _show(title: str, rows: dict[str, dict[str, float]]) -> None:
    columns = list(dict.fromkeys(c for row in rows.values() for c in row))
    print(f"\n{title}")
    print(f"  {'':34}" + "".join(f"{c:>16}" for c in columns))
    for name, row in rows.items():
        cells = "".join(
            f"{row[c]:>16.4g}" if c in row else f"{'':>16}" for c in columns
        )
        print(f"  {name:34}{cells}")


def _split_by_ranks(means, variances, y, seed) -> dict[str, float]:
    """MAPIE's split interval rebuilt by hand, to check the explanation of
    the difference: `mean - s_(lo) std .. mean + s_(hi) std` with `s_(hi)`
    the `ceil((n + 1)(1 - alpha))`-th smallest score (ours, both sides) and
    `s_(lo)` the `ceil(alpha (n + 1))`-th largest."""
    y = np.asarray(y, np.float64)
    order = np.random.default_rng(seed).permutation(len(y))
    halves = (order[: len(y) // 2], order[len(y) // 2 :])
    mean, std = _mixture(means, variances)
    coverage, width = [], []
    for calibrate, score in (halves, halves[::-1]):
        n = len(calibrate)
        s = np.sort(np.abs(y[calibrate] - mean[calibrate]) / std[calibrate])
        high = s[math.ceil((n + 1) * (1 - ALPHA) - 1e-9) - 1]
        low = s[n - math.ceil(ALPHA * (n + 1) - 1e-9)]
        lo, hi = mean[score] - low * std[score], mean[score] + high * std[score]
        coverage.append(((lo <= y[score]) & (y[score] <= hi)).mean())
        width.append((hi - lo).mean())
    return {"split 90% coverage": np.mean(coverage), "split 90% width": np.mean(width)}


def sanity_regression(epochs: int, tabm_epochs: int) -> None:
    import jax.numpy as jnp
    import results

    for name, (x, y) in results.regression_sets().items():
        split = 0
        train, (x_test, y_test), (y_mean, y_std) = results.regression_split(x, y, split)
        means, variances, ours_s = _our_regression(x, y, split, epochs)
        y_true = jnp.asarray(y_test, jnp.float32)
        rows = {}
        rows["ours: deep ensemble (5)"] = _regression_scores(means, variances, y_test)
        rows["ours: deep ensemble (5)"]["train s"] = ours_s
        ours_conformal = results.conformal_regression(means, variances, y_true, split)
        begin = time.perf_counter()
        theirs = mapie_regression(means, variances, y_true, split)
        mapie_s = time.perf_counter() - begin
        conformal = {
            "ee.conformal on ours": ours_conformal,
            "MAPIE on ours": theirs | {"calibrate s": mapie_s},
        }
        for label, model in (("3 x 512", {}), ("1 x 50 recipe", TABM_RECIPE)):
            t_means, t_vars, t_count, t_s = tabm_regression(
                train, x_test, split, tabm_epochs, **model
            )
            t_means, t_vars = t_means * y_std + y_mean, t_vars * y_std**2
            row = f"TabM k=32 {label}"
            rows[row] = _regression_scores(t_means, t_vars, y_test)
            rows[row] |= {"train s": t_s, "parameters": t_count}
            conformal[f"ee.conformal on TabM {label}"] = results.conformal_regression(
                jnp.asarray(t_means), jnp.asarray(t_vars), y_true, split
            )
            conformal[f"MAPIE on TabM {label}"] = mapie_regression(
                t_means, t_vars, y_true, split
            )
        rows |= mapie_own_regression(
            train, (x_test, y_test), (y_mean, y_std), split, epochs
        )
        _show(f"{name}, split 0, {epochs} epochs (TabM {tabm_epochs})", rows)
        _show(f"{name}, split 0: conformal at 90% (cross-fitted halves)", conformal)
        gaps = {k: f"{abs(ours_conformal[k] - theirs[k]):.2g}" for k in theirs}
        print("  |ee.conformal - MAPIE| on our predictions:", gaps)
        by_hand = _split_by_ranks(means, variances, y_true, split)
        gaps = {k: f"{abs(by_hand[k] - theirs[k]):.2g}" for k in by_hand}
        print("  |MAPIE - split with MAPIE's lower rank, by hand|:", gaps)


def sanity_classification(steps: int, with_mnist: bool, draws: int = 20) -> None:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    import results

    import eqx_ensemble as ee

    keep = ("APS coverage", "APS size", "RAPS coverage", "RAPS size")
    for name, data in results.classification_sets(with_mnist).items():
        split = results.classification_split(data, 0)
        split["ood"] = {}  # not scored here
        features, classes = split["train"][0].shape[1], split["classes"]
        key = jax.random.key(0)
        ens = ee.ensemble(
            lambda k: eqx.nn.MLP(features, classes, results.WIDTH, 2, key=k),
            size=results.MEMBERS, key=key,
        )  # fmt: skip
        run = ee.fit(
            ens, results.cross_entropy, optax.adam(1e-3), split["train"],
            steps=steps, batch_size=results.BATCH, key=jax.random.fold_in(key, 1),
            sampling=ee.Independent(), callbacks=(),
        )  # fmt: skip
        predict = results.softmax_of(run.ensemble)
        ours, _ = results.score_classification(predict, split)
        (val_x, val_y), (test_x, test_y) = split["val"], split["test"]
        val_probs, test_probs = predict(val_x), predict(test_x)
        begin = time.perf_counter()
        theirs = mapie_classification(val_probs, val_y, test_probs, test_y)
        seconds = time.perf_counter() - begin
        title = (
            f"{name}, seed 0, deep ensemble ({steps} steps, accuracy "
            f"{ours['accuracy']:.3f}): conformal sets at 90%"
        )
        if not theirs:
            print(f"\n{title}\n  MAPIE: no row. {MAPIE_BINARY}")
            continue
        rows = {
            "ee.conformal (score_classification)": {k: ours[k] for k in keep},
            "MAPIE (random_state=17)": theirs | {"calibrate s": seconds},
        }
        # Randomized sets: their spread over the uniforms, for both libraries.
        mine = []
        for draw in range(draws):
            k1, k2 = jax.random.split(jax.random.key(100 + draw))
            one = {}
            for kind, calibrate in (
                ("APS", ee.conformal.aps),
                ("RAPS", ee.conformal.raps),
            ):
                sets = calibrate(val_probs, val_y, alpha=ALPHA, key=k1).sets(
                    test_probs, key=k2
                )
                picked = jnp.take_along_axis(sets, test_y[:, None], axis=1)[:, 0]
                one[f"{kind} coverage"] = float(jnp.mean(picked))
                one[f"{kind} size"] = float(jnp.mean(jnp.sum(sets, axis=1)))
            mine.append(one)
        other = [
            mapie_classification(
                val_probs, val_y, test_probs, test_y,
                random_state=np.random.RandomState(draw),
            )
            for draw in range(draws)
        ]  # fmt: skip
        for label, found in (("ee.conformal", mine), ("MAPIE", other)):
            rows[f"{label}, mean of {draws} draws"] = {
                k: float(np.mean([d[k] for d in found])) for k in keep
            }
            rows[f"{label}, sd of {draws} draws"] = {
                k: float(np.std([d[k] for d in found], ddof=1)) for k in keep
            }
        _show(title, rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a toy size")
    parser.add_argument("--mnist", action="store_true", help="MNIST-5k too")
    parser.add_argument("--only", choices=("regression", "classification"))
    args = parser.parse_args(argv)
    epochs, tabm_epochs, steps = (4, 2, 80) if args.quick else (40, 40, 2000)
    print("versions:", versions())
    if args.only != "classification":
        sanity_regression(epochs, tabm_epochs)
    if args.only != "regression":
        sanity_classification(steps, args.mnist)


if __name__ == "__main__":
    main()
