"""eqx_ensemble: ensembles of Equinox models as one stacked module.

```python
import eqx_ensemble as ee
ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 1, 32, 2, key=k), size=8,
                  key=jax.random.key(0))
ens(jnp.ones(2))   # shape (8, 1): one output per member, one compiled computation
```
"""

from . import (
    combine as combine,
    conformal as conformal,
    metrics as metrics,
    nn as nn,
    plot as plot,
    schedules as schedules,
    sweep as sweep,
)
from ._adversarial import Adversarial as Adversarial, adversarial as adversarial
from ._allocator import keep_scratch_memory as keep_scratch_memory
from ._average import average as average, tree_weighted_sum as tree_weighted_sum
from ._batch_stats import recompute_batch_stats as recompute_batch_stats
from ._checkpoint import load as load, load_manifest as load_manifest, save as save
from ._checkpoint_dir import (
    latest_checkpoint as latest_checkpoint,
    list_checkpoints as list_checkpoints,
    save_checkpoint as save_checkpoint,
    verify_checkpoint as verify_checkpoint,
)
from ._checkpoint_file import CheckpointError as CheckpointError
from ._control import Controller as Controller
from ._coupled import Coupled as Coupled, distillation_loss as distillation_loss
from ._ensemble import Ensemble as Ensemble, ensemble as ensemble
from ._evaluate import Evaluate as Evaluate
from ._fit import fit as fit
from ._fit_checkpoints import Checkpoints as Checkpoints
from ._history import History as History
from ._map import map as map
from ._optim import (
    SharedOptState as SharedOptState,
    init_optimizer as init_optimizer,
    set_hyperparams as set_hyperparams,
)
from ._pbt import PBT as PBT
from ._predict import predict as predict
from ._result import (
    EnsembleDivergedError as EnsembleDivergedError,
    FitResult as FitResult,
)
from ._sampling import (
    Bootstrap as Bootstrap,
    Independent as Independent,
    Sampling as Sampling,
    Shared as Shared,
)
from ._select import greedy_selection as greedy_selection, greedy_soup as greedy_soup
from ._sharding import (
    make_mesh as make_mesh,
    process_rows as process_rows,
    shard as shard,
)
from ._stack import concatenate as concatenate, stack as stack, unstack as unstack
from ._step import Step as Step, StepOutput as StepOutput, make_step as make_step
from ._track import EMA as EMA, SWA as SWA, Tracker as Tracker
from ._track_more import (
    SWAG as SWAG,
    Snapshots as Snapshots,
    SWAGPosterior as SWAGPosterior,
)
from ._train_state import TrainState as TrainState

__version__ = "0.1.0"
