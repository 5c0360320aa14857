"""eqx_ensemble: ensembles of Equinox models as one stacked module.

```python
import eqx_ensemble as ee
ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 1, 32, 2, key=k), size=8,
                  key=jax.random.key(0))
ens(jnp.ones(2))   # shape (8, 1): one output per member, one compiled computation
```
"""

from . import combine as combine
from ._average import average as average, tree_weighted_sum as tree_weighted_sum
from ._ensemble import Ensemble as Ensemble, ensemble as ensemble
from ._map import map as map
from ._stack import concatenate as concatenate, stack as stack, unstack as unstack

__version__ = "0.1.0"
