"""Uncertainty, calibration and accuracy metrics for stacked ensemble predictions.

Conventions, shared by every function:

- **Inputs are stacked per member**, members first, as returned by `ens(x)` or
  `ee.map`: classification predictions have shape `(members, batch, classes)`,
  regression means and variances `(members, batch)`, or `(members, batch,
  outputs)` for several outputs (`(members, batch, 1)`, what
  `eqx.nn.MLP(out_size=1)` gives, counts as one output). For a single model add
  a member axis with `x[None]`. Labels are integers of shape `(batch,)`,
  regression targets floats of shape `(batch,)` (or `(batch, outputs)`).
- **Several regression outputs** are treated as independent: per-example
  quantities (`predictive_mean`, the variances) keep the output axis; the
  Gaussian NLLs sum over outputs (the joint NLL of independent outputs);
  `rmse` and `interval_coverage` average over every (example, output) pair.
- **Probabilities or logits.** Classification functions take probabilities
  (each row summing to one) by default; pass `from_logits=True` to give logits,
  which is the numerically exact path (log-softmax per member, `logsumexp` over
  members). Probabilities of exactly 0 or 1 give finite values (`0 log 0 = 0`).
- **The ensemble's prediction** is the mean of the members' probabilities
  (`ee.combine.mean_probs`), or for regression the Gaussian mixture
  `(1/M) sum_i N(mu_i, s_i^2)` (`ee.combine.gaussian_mixture`).
- **Reductions.** Scores of a whole data set (`accuracy`, `nll`, `brier_score`,
  the calibration errors, `gaussian_nll`, `rmse`, `interval_coverage`,
  `ood_auroc`) return a scalar; `nll`, `brier_score` and `gaussian_nll` take
  `reduction="none"` for one value per example (or `"sum"`). Uncertainty
  measures (`predictive_entropy`, `expected_entropy`, `mutual_information`,
  `variation_ratio`, `disagreement`, the variances) return one value per example,
  shape `(batch,)`, ready to rank inputs or feed to `ood_auroc`. `per_member_*`
  functions score each member alone and return shape `(members,)`.
- **Units.** Entropies and NLLs are in nats. The Brier score is **summed over
  classes** (range `[0, 2]`; twice scikit-learn's binary score for two classes).
- **Checks.** Bad input raises before any computation, naming the argument and
  its shape: probabilities outside `[0, 1]` or not summing to one (within 1e-3),
  labels out of range or not matching the batch, `n_bins < 1`, negative
  variances. Value checks need concrete arrays and are skipped under `jax.jit`;
  shape checks always run.
- **jit.** Every function runs under `jax.jit` (non-array options such as
  `n_bins`, `reduction`, `from_logits` are static).

```python
logits = jax.random.normal(jax.random.key(0), (5, 32, 10))   # (members, batch, classes)
labels = jnp.arange(32) % 10
ee.metrics.nll(logits, labels, from_logits=True)             # scalar
ee.metrics.mutual_information(logits, from_logits=True)     # shape (32,)
ee.metrics.per_member_accuracy(logits, labels, from_logits=True)  # shape (5,)
```
"""

from ._metrics.calibration import (
    CalibrationBins as CalibrationBins,
    adaptive_calibration_error as adaptive_calibration_error,
    calibration_bins as calibration_bins,
    expected_calibration_error as expected_calibration_error,
    max_calibration_error as max_calibration_error,
    per_member_calibration_error as per_member_calibration_error,
)
from ._metrics.classification import (
    accuracy as accuracy,
    brier_score as brier_score,
    nll as nll,
    per_member_accuracy as per_member_accuracy,
    per_member_brier_score as per_member_brier_score,
    per_member_nll as per_member_nll,
)
from ._metrics.ood import (
    ood_aupr as ood_aupr,
    ood_auroc as ood_auroc,
    ood_fpr_at_tpr as ood_fpr_at_tpr,
)
from ._metrics.quantile import (
    regression_calibration_error as regression_calibration_error,
)
from ._metrics.regression import (
    aleatoric_variance as aleatoric_variance,
    epistemic_variance as epistemic_variance,
    gaussian_nll as gaussian_nll,
    interval_coverage as interval_coverage,
    per_member_gaussian_nll as per_member_gaussian_nll,
    per_member_rmse as per_member_rmse,
    predictive_mean as predictive_mean,
    predictive_variance as predictive_variance,
    rmse as rmse,
)
from ._metrics.selective import (
    accuracy_at_coverage as accuracy_at_coverage,
    augrc as augrc,
    aurc as aurc,
    risk_coverage_curve as risk_coverage_curve,
)
from ._metrics.temperature import (
    TemperatureAtBoundWarning as TemperatureAtBoundWarning,
    apply_temperature as apply_temperature,
    fit_temperature as fit_temperature,
)
from ._metrics.uncertainty import (
    disagreement as disagreement,
    energy_score as energy_score,
    expected_entropy as expected_entropy,
    max_logit_score as max_logit_score,
    max_probability_score as max_probability_score,
    mutual_information as mutual_information,
    pairwise_disagreement as pairwise_disagreement,
    predictive_entropy as predictive_entropy,
    variation_ratio as variation_ratio,
)

__all__ = [
    # Classification: scores of the ensemble's mean prediction.
    "accuracy",
    "nll",
    "brier_score",
    # Classification: each member alone.
    "per_member_accuracy",
    "per_member_nll",
    "per_member_brier_score",
    "per_member_calibration_error",
    # Uncertainty of each prediction.
    "predictive_entropy",
    "expected_entropy",
    "mutual_information",
    "variation_ratio",
    "disagreement",
    "pairwise_disagreement",
    # Calibration.
    "calibration_bins",
    "CalibrationBins",
    "expected_calibration_error",
    "adaptive_calibration_error",
    "max_calibration_error",
    "fit_temperature",
    "TemperatureAtBoundWarning",
    "apply_temperature",
    # Regression.
    "predictive_mean",
    "predictive_variance",
    "aleatoric_variance",
    "epistemic_variance",
    "gaussian_nll",
    "per_member_gaussian_nll",
    "rmse",
    "per_member_rmse",
    "interval_coverage",
    "regression_calibration_error",
    # Out-of-distribution detection: scores (higher = more likely OOD; the
    # uncertainty measures above are scores too) and how well they separate.
    "energy_score",
    "max_logit_score",
    "max_probability_score",
    "ood_auroc",
    "ood_aupr",
    "ood_fpr_at_tpr",
    # Selective prediction.
    "risk_coverage_curve",
    "aurc",
    "augrc",
    "accuracy_at_coverage",
]
