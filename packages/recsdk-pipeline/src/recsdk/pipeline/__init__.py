"""recsdk-pipeline: train/eval pipelines that overlap host id work with device compute.

Also re-exports TorchRec's optimizer helpers used with them, so one import serves the
whole flow.
"""

from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recsdk.pipeline.host_staged import HostStagedModule
from recsdk.pipeline.host_worker import HostStageError, HostWorker
from recsdk.pipeline.train_pipeline import MAX_PIPE_N_BATCH, HybridTrainPipelineSparseDist

__all__ = [
    "MAX_PIPE_N_BATCH",
    "CombinedOptimizer",
    "HostStageError",
    "HostStagedModule",
    "HostWorker",
    "HybridTrainPipelineSparseDist",
    "KeyedOptimizerWrapper",
    "apply_optimizer_in_backward",
    "in_backward_optimizer_filter",
]
