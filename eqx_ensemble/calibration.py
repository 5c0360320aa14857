"""Post-hoc calibration on a held-out calibration split, beyond one temperature
(`ee.metrics.fit_temperature`).

Parametric maps act on logits and return logits, applied to each member (one map for
the ensemble, fitted to its mean prediction's NLL, or one per member):

- [`fit_vector_scaling`][eqx_ensemble.calibration.fit_vector_scaling]: `w * z + b`
  (Guo et al. 2017).
- [`fit_matrix_scaling`][eqx_ensemble.calibration.fit_matrix_scaling]: `W z + b`
  (Guo et al. 2017).
- [`fit_dirichlet_scaling`][eqx_ensemble.calibration.fit_dirichlet_scaling]:
  `W log p + b` with the off-diagonal penalty (Kull et al. 2019).

Non-parametric maps act on probabilities, one-vs-rest per class, and return
probabilities: of the ensemble's mean prediction, shape `(1, batch, classes)`, or of
each member:

- [`fit_histogram_binning`][eqx_ensemble.calibration.fit_histogram_binning]
  (Zadrozny and Elkan 2001).
- [`fit_isotonic_regression`][eqx_ensemble.calibration.fit_isotonic_regression]
  (Zadrozny and Elkan 2002).

For regression, on the members' means and variances:
[`fit_quantile_recalibration`][eqx_ensemble.calibration.fit_quantile_recalibration],
an isotonic map of the predictive CDF's values (Kuleshov et al. 2018), giving
calibrated quantiles and intervals.

Every fitted calibrator is an `eqx.Module`: save it with `ee.save`, call it under
`jax.jit`, feed its output to any `ee.metrics` function.

```python
key_logits, key_labels = jax.random.split(jax.random.key(0))
logits = 4 * jax.random.normal(key_logits, (5, 1000, 10))   # (members, batch, classes)
labels = jax.random.randint(key_labels, (1000,), 0, 10)
calibrate = ee.calibration.fit_vector_scaling(logits[:, :500], labels[:500])
ee.metrics.expected_calibration_error(calibrate(logits[:, 500:]), labels[500:],
                                      from_logits=True)
```
"""

from ._metrics.calibrators import (
    DirichletScaling as DirichletScaling,
    HistogramBinning as HistogramBinning,
    IsotonicCalibration as IsotonicCalibration,
    MatrixScaling as MatrixScaling,
    VectorScaling as VectorScaling,
    fit_dirichlet_scaling as fit_dirichlet_scaling,
    fit_histogram_binning as fit_histogram_binning,
    fit_isotonic_regression as fit_isotonic_regression,
    fit_matrix_scaling as fit_matrix_scaling,
    fit_vector_scaling as fit_vector_scaling,
)
from ._metrics.quantile import (
    QuantileRecalibration as QuantileRecalibration,
    fit_quantile_recalibration as fit_quantile_recalibration,
)

__all__ = [
    "fit_vector_scaling",
    "fit_matrix_scaling",
    "fit_dirichlet_scaling",
    "fit_histogram_binning",
    "fit_isotonic_regression",
    "fit_quantile_recalibration",
    "VectorScaling",
    "MatrixScaling",
    "DirichletScaling",
    "HistogramBinning",
    "IsotonicCalibration",
    "QuantileRecalibration",
]
