"""functional_shard: fully sharded data parallelism (FSDP / ZeRO-3) as explicit, pure transforms.

    mesh = fs.init_mesh({"fsdp": 2})
    apply_fn, params = fs.functionalize(model)
    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3))
    state = step.init(params)
    state, metrics = step(state, batch)
"""

from . import analysis as analysis
from . import optim as optim
from . import precision as precision
from . import checkpoint as checkpoint
from . import data as data
from . import initialize as initialize
from . import testing as testing
from . import tensor_parallel as tensor_parallel
from . import pipeline as pipeline
from ._export import export as export
from ._export_file import ExportError as ExportError
from ._functionalize import functionalize as functionalize
from ._failures import Failure as Failure
from ._failures import FailureKind as FailureKind
from ._launch import RankError as RankError
from ._launch import keep_freed_memory as keep_freed_memory
from ._launch import launch as launch
from ._layout import BufferSpec as BufferSpec
from ._layout import Layout as Layout
from ._layout import LayoutError as LayoutError
from ._layout import make_layout as make_layout
from ._mesh import BaseMesh as BaseMesh
from ._mesh import Mesh as Mesh
from ._mesh import MeshError as MeshError
from ._mesh import PeerError as PeerError
from ._reference import WeightedLoss as WeightedLoss
from ._nonfinite import NonFinite as NonFinite
from ._nonfinite import NonFiniteError as NonFiniteError
from .precision import LossScale as LossScale
from .precision import LossScaleState as LossScaleState
from .precision import Precision as Precision
from ._simulated import SimulatedMesh as SimulatedMesh
from ._mesh import init_mesh as init_mesh
from ._mesh import shutdown as shutdown
from ._pool import WorkerPool as WorkerPool
from ._shard import Sharded as Sharded
from ._shard import all_reduce as all_reduce
from ._shard import gather as gather
from ._shard import reduce_scatter as reduce_scatter
from ._shard import shard as shard
from ._step import ShardedStep as ShardedStep
from ._step import StepError as StepError
from ._step import StepState as StepState
from ._make_step import sharded_step as sharded_step
from ._jit import TraceError as TraceError
from ._pytree import NAMESPACE as PYTREE_NAMESPACE
from ._pytree import pytree_dataclass as pytree_dataclass
from ._pytree import static_field as static_field
from ._pytree import tree_flatten as tree_flatten
from ._pytree import tree_leaves as tree_leaves
from ._pytree import tree_map as tree_map
from ._pytree import tree_paths as tree_paths
from ._pytree import tree_structure as tree_structure
from ._pytree import tree_unflatten as tree_unflatten
from ._tree import ModuleParams as ModuleParams
from . import schedule as schedule
from .schedule import Schedule as Schedule
from ._units import BlockUnits as BlockUnits
from ._units import UnitPolicy as UnitPolicy
from ._units import units_by_block as units_by_block

__version__ = "0.1.0"

__all__ = [
    "ExportError",
    "BaseMesh",
    "BlockUnits",
    "BufferSpec",
    "Failure",
    "FailureKind",
    "Layout",
    "LayoutError",
    "LossScale",
    "LossScaleState",
    "Mesh",
    "MeshError",
    "PYTREE_NAMESPACE",
    "Precision",
    "PeerError",
    "ModuleParams",
    "NonFinite",
    "NonFiniteError",
    "RankError",
    "Schedule",
    "ShardedStep",
    "Sharded",
    "SimulatedMesh",
    "StepError",
    "StepState",
    "TraceError",
    "UnitPolicy",
    "WeightedLoss",
    "WorkerPool",
    "all_reduce",
    "analysis",
    "checkpoint",
    "data",
    "export",
    "functionalize",
    "gather",
    "init_mesh",
    "initialize",
    "keep_freed_memory",
    "launch",
    "make_layout",
    "optim",
    "pipeline",
    "precision",
    "pytree_dataclass",
    "reduce_scatter",
    "schedule",
    "shard",
    "sharded_step",
    "shutdown",
    "static_field",
    "tensor_parallel",
    "testing",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_paths",
    "tree_structure",
    "tree_unflatten",
    "units_by_block",
]
