"""eqx_ensemble: ensembles of Equinox models as one stacked module.

```python
import eqx_ensemble as ee
ens = ee.ensemble(lambda k: eqx.nn.MLP(2, 1, 32, 2, key=k), size=8,
                  key=jax.random.key(0))
ens(jnp.ones(2))   # shape (8, 1): one output per member, one compiled computation
```
"""

from . import (
    calibration as calibration,
    combine as combine,
    conformal as conformal,
    losses as losses,
    metrics as metrics,
    nn as nn,
    ood as ood,
    plot as plot,
    predictive as predictive,
    schedules as schedules,
    sgmcmc as sgmcmc,
    sweep as sweep,
)
from ._checkpoints.component import Checkpoints as Checkpoints
from ._checkpoints.directory import (
    latest_checkpoint as latest_checkpoint,
    list_checkpoints as list_checkpoints,
    save_checkpoint as save_checkpoint,
    verify_checkpoint as verify_checkpoint,
)
from ._checkpoints.file import CheckpointError as CheckpointError
from ._checkpoints.io import load as load, load_manifest as load_manifest, save as save
from ._controllers.early_stopping import EarlyStopping as EarlyStopping
from ._controllers.pbt import PBT as PBT
from ._core.ensemble import Ensemble as Ensemble, ensemble as ensemble
from ._core.heterogeneous import Heterogeneous as Heterogeneous
from ._core.map import map as map
from ._core.predict import predict as predict
from ._core.sharding import (
    shard as shard,
)
from ._core.stack import concatenate as concatenate, stack as stack, unstack as unstack
from ._execution.disk_cache import compilation_cache as compilation_cache
from ._execution.execution import Execution as Execution
from ._execution.placement import (
    make_mesh as make_mesh,
    process_rows as process_rows,
)
from ._loggers.files import CSVLogger as CSVLogger
from ._loggers.tensorboard import TensorBoardLogger as TensorBoardLogger
from ._loggers.weights_and_biases import WandbLogger as WandbLogger
from ._methods.adversarial import Adversarial as Adversarial, adversarial as adversarial
from ._methods.augment import (
    AugmentedPass as AugmentedPass,
    test_time_augmentation as test_time_augmentation,
)
from ._methods.average import average as average, tree_weighted_sum as tree_weighted_sum
from ._methods.batch_stats import (
    mc_batchnorm as mc_batchnorm,
    recompute_batch_stats as recompute_batch_stats,
)
from ._methods.select import (
    greedy_selection as greedy_selection,
    greedy_soup as greedy_soup,
)
from ._methods.svgd import repulsive as repulsive, svgd as svgd
from ._posteriors.dropout import DropoutPass as DropoutPass, mc_dropout as mc_dropout
from ._posteriors.laplace import (
    LaplacePosterior as LaplacePosterior,
    PriorAtGridEndWarning as PriorAtGridEndWarning,
    laplace as laplace,
)
from ._trackers.averages import EMA as EMA, SWA as SWA
from ._trackers.snapshots import Snapshots as Snapshots
from ._trackers.swag import SWAG as SWAG, SWAGPosterior as SWAGPosterior
from ._training.callback import (
    Callback as Callback,
    RunSetup as RunSetup,
    RunView as RunView,
)
from ._training.controller import Controller as Controller
from ._training.coupled import (
    Coupled as Coupled,
    distillation_loss as distillation_loss,
)
from ._training.epochs import Epochs as Epochs, epochs as epochs
from ._training.evaluate import Evaluate as Evaluate
from ._training.fit import fit as fit
from ._training.history import History as History
from ._training.loggers import (
    LogEntry as LogEntry,
    Logger as Logger,
    RunInfo as RunInfo,
)
from ._training.optim import (
    SharedOptState as SharedOptState,
    init_optimizer as init_optimizer,
    set_hyperparams as set_hyperparams,
)
from ._training.progress import (
    ProgressBar as ProgressBar,
    ProgressMeter as ProgressMeter,
)
from ._training.result import (
    EnsembleDivergedError as EnsembleDivergedError,
    FitResult as FitResult,
)
from ._training.sampling import (
    Bootstrap as Bootstrap,
    Independent as Independent,
    Sampling as Sampling,
    Shared as Shared,
)
from ._training.step import (
    Step as Step,
    StepOutput as StepOutput,
    make_step as make_step,
)
from ._training.tracker import Tracker as Tracker
from ._training.train_state import TrainState as TrainState

__version__ = "0.2.0"
