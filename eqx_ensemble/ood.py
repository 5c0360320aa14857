"""Out-of-distribution detectors in the members' feature space, fitted on the
training features of each member (the ensemble's score: the mean over members).

- [`fit_mahalanobis`][eqx_ensemble.ood.fit_mahalanobis]: the smallest
  Mahalanobis distance to a class mean, one shared covariance (Lee et al. 2018).
- [`fit_gaussian_density`][eqx_ensemble.ood.fit_gaussian_density]: minus the
  log density under class-conditional Gaussians (DDU, Mukhoti et al. 2023).
- [`fit_knn`][eqx_ensemble.ood.fit_knn]: the distance to the k-th nearest
  normalised training feature (Sun et al. 2022).

Scores are higher for inputs more likely out of distribution, as the scores of
`ee.metrics` (rank them with `ee.metrics.ood_auroc`). The features come from a
function of each member: for MLPs and Sequentials, everything but the last
layer, [`penultimate_features`][eqx_ensemble.ood.penultimate_features];
for any other model, a function of one member through `ee.map`:

```python
ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 3, 16, 2, key=k), size=4,
                  key=jax.random.key(0))

def features(x):
    return ee.ood.penultimate_features(ens, x)       # (members, batch, 16)

x = jax.random.normal(jax.random.key(1), (300, 2))
labels = (x[:, 0] > 0).astype(jnp.int32) + (x[:, 1] > 0).astype(jnp.int32)
detector = ee.ood.fit_mahalanobis(features(x), labels)
far = 10.0 + x
ee.metrics.ood_auroc(detector(features(x)).mean(0), detector(features(far)).mean(0))
```
"""

from ._metrics.features import (
    KNN as KNN,
    GaussianDensity as GaussianDensity,
    Mahalanobis as Mahalanobis,
    fit_gaussian_density as fit_gaussian_density,
    fit_knn as fit_knn,
    fit_mahalanobis as fit_mahalanobis,
    penultimate_features as penultimate_features,
)

__all__ = [
    "fit_mahalanobis",
    "fit_gaussian_density",
    "fit_knn",
    "Mahalanobis",
    "GaussianDensity",
    "KNN",
    "penultimate_features",
]
