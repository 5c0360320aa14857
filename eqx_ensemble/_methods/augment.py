"""`test_time_augmentation`: one trained model's predictions on augmented
copies of its input, as an ensemble whose members are the augmentations."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from .._core.ensemble import Ensemble
from .._core.heterogeneous import is_ensemble
from .._internal.checks import check_positive_int
from .._internal.keys import check_key


class AugmentedPass(eqx.Module):
    """One augmentation of a test-time-augmented model: `model(augment(key,
    x))`. A member of the ensemble
    [`ee.test_time_augmentation`][eqx_ensemble.test_time_augmentation] makes
    (see there).

    **Example:**

    ```python
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    flip = lambda key, x: jnp.where(jax.random.bernoulli(key), x[::-1], x)
    passes = ee.test_time_augmentation(model, flip, passes=4, key=jax.random.key(1))
    passes[0](jnp.ones(3)).shape                 # (2,): one augmentation's
    ```
    """

    model: Any
    augment: Callable[[PRNGKeyArray, Any], Any] = eqx.field(static=True)
    key: Any  # one key per pass (stacked), or one pass's

    def __call__(self, x: Any, **kwargs: Any) -> Any:
        return self.model(self.augment(self.key, x), **kwargs)


def test_time_augmentation(
    model: Any,
    augment: Callable[[PRNGKeyArray, Any], Any],
    *,
    passes: int,
    key: PRNGKeyArray,
) -> Ensemble:
    """Test-time augmentation (e.g. Wang et al. 2019; Ashukha et al. 2020) as
    an ensemble: `passes` augmentations of the input through ONE trained
    model, each a member that holds its PRNG key; the model is held once, as
    the ensemble's shared part. So [`ee.predict`][eqx_ensemble.predict],
    `ens(x)`, every metric, combination, calibrator and conformal method take
    the augmentations' predictions, `(passes, batch, ...)`, as they take
    members', in one vectorised program.

    A pass applies its augmentation, `augment(its_key, x)` for each example
    `x`, with one key for the whole batch (the same transform of every
    example: a flip, a shift, a crop drawn once per pass). For an ensemble,
    augment each member and hold them as groups, members x passes in one
    prediction: `ee.Heterogeneous([ee.test_time_augmentation(ens[i], ...)
    for i in range(len(ens))])`.

    **Arguments:**

    - `model`: one trained model, called as `model(x)` on one example.
    - `augment`: `augment(key, x) -> x'`, one example's augmentation (the
      shape of `x` kept), traceable JAX code.
    - `passes`: the number of augmentations, `>= 1`.
    - `key`: PRNG key; pass `i` uses `jax.random.split(key, passes)[i]`.

    **Returns:**

    An [`ee.Ensemble`][eqx_ensemble.Ensemble] of `passes`
    [`ee.AugmentedPass`][eqx_ensemble.AugmentedPass] members.

    **Example:**

    ```python
    model = eqx.nn.MLP(8, 3, 16, 1, key=jax.random.key(0))
    def shift(key, x):                           # a random circular shift
        return jnp.roll(x, jax.random.randint(key, (), -2, 3))
    passes = ee.test_time_augmentation(model, shift, passes=10,
                                       key=jax.random.key(1))
    logits = ee.predict(passes, jax.random.normal(jax.random.key(2), (5, 8)))
    logits.shape                                  # (10, 5, 3)
    probs = ee.combine.mean_probs_from_logits(logits)   # the averaged prediction
    ```
    """
    passes = check_positive_int(passes, "passes")
    check_key(key)
    if is_ensemble(model):
        raise TypeError(
            f"`ee.test_time_augmentation` takes ONE model, got an "
            f"`{type(model).__name__}`; for an ensemble, call it per member "
            "(`ens[i]`) and hold the results as groups of an `ee.Heterogeneous`"
        )
    if not callable(augment):
        raise TypeError(f"`augment` must be a function (key, x) -> x, got {augment!r}")
    members = AugmentedPass(
        eqx.filter(model, eqx.is_array, inverse=True),
        augment,
        jax.random.split(key, passes),
    )
    return Ensemble(members, AugmentedPass(model, augment, None))
