"""Cyclic learning-rate schedules for snapshot ensembles and fast geometric
ensembling, as optax schedules, with the matching snapshot steps for
[`ee.Snapshots`][eqx_ensemble.Snapshots].

```python
schedule = ee.schedules.cosine_cycles(0.1, cycle_steps=100, cycles=5)
snapshots = ee.Snapshots(at=ee.schedules.cycle_ends(100, 5))
```
"""

from ._trackers.cycles import (
    cosine_cycles as cosine_cycles,
    cycle_ends as cycle_ends,
    fge_snapshots as fge_snapshots,
    triangular_cycles as triangular_cycles,
)

__all__ = ["cosine_cycles", "cycle_ends", "triangular_cycles", "fge_snapshots"]
