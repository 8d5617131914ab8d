"""Analysis of a traced step before it runs, and against how it ran: costs, memory, timelines.

    compiled = step.lower(state, batch)
    report = fs.analysis.analyze(compiled)      # FLOPs per unit, collective bytes, peak memory
    result = fs.analysis.autotune(step, state, batch, budget_bytes=8 << 30)   # the fastest schedule that fits
"""

from ._abstract import AbstractMesh as AbstractMesh
from ._abstract import abstract_state as abstract_state
from ._abstract import plan as plan
from ._autotune import SearchSpace as SearchSpace
from ._autotune import TuneCandidate as TuneCandidate
from ._autotune import TuneResult as TuneResult
from ._autotune import autotune as autotune
from ._analyze import Analysis as Analysis
from ._calibrate import calibrate as calibrate
from ._layouts import LayoutCandidate as LayoutCandidate
from ._layouts import LayoutPlan as LayoutPlan
from ._layouts import LayoutSpace as LayoutSpace
from ._layouts import plan_layouts as plan_layouts
from ._cluster import A100_SXM_80GB as A100_SXM_80GB
from ._cluster import FITTED as FITTED
from ._cluster import GPU as GPU
from ._cluster import H100_SXM as H100_SXM
from ._cluster import H100_SXM_HBM2E as H100_SXM_HBM2E
from ._cluster import Efficiency as Efficiency
from ._cluster import cluster_machine as cluster_machine
from ._eager_checkpoint import eager_checkpoint_cache_bytes as eager_checkpoint_cache_bytes
from ._machine import Machine as Machine
from ._machine import h100_sxm as h100_sxm
from ._machine import load_machine as load_machine
from ._simulate import Simulation as Simulation
from ._simulate import simulate as simulate
from ._analyze import CollectiveCost as CollectiveCost
from ._analyze import UnitCost as UnitCost
from ._analyze import analyze as analyze
from ._memory import MemoryBreakdown as MemoryBreakdown
from ._cuts import PipelineCandidate as PipelineCandidate
from ._pipeline import balance_stages as balance_stages
from ._pipeline import PipelinePlan as PipelinePlan
from ._pipeline import StagePlan as StagePlan
from ._pipeline import pipeline_chrome_trace as pipeline_chrome_trace
from ._pipeline import plan_pipeline as plan_pipeline
from ._cuts import tune_pipeline as tune_pipeline
from ._memory import MemoryEstimate as MemoryEstimate
from ._timeline import Profile as Profile
from ._timeline import TraceEvent as TraceEvent
from ._timeline import chrome_trace as chrome_trace
from ._timeline import plot_gantt as plot_gantt
from ._timeline import profile as profile
from ._timeline import save_chrome_trace as save_chrome_trace

__all__ = ["A100_SXM_80GB", "Efficiency", "FITTED", "GPU", "H100_SXM", "H100_SXM_HBM2E", "cluster_machine", "AbstractMesh", "Analysis", "LayoutCandidate", "LayoutPlan", "LayoutSpace", "plan_layouts", "SearchSpace", "TuneCandidate", "TuneResult", "autotune", "CollectiveCost", "MemoryBreakdown", "Machine", "MemoryEstimate", "PipelineCandidate", "PipelinePlan", "StagePlan", "balance_stages", "pipeline_chrome_trace", "plan_pipeline", "tune_pipeline", "Profile", "Simulation", "TraceEvent", "UnitCost", "abstract_state", "analyze", "calibrate", "chrome_trace", "eager_checkpoint_cache_bytes", "h100_sxm", "load_machine", "plan", "plot_gantt", "profile", "save_chrome_trace", "simulate"]
