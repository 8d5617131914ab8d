"""Analysis of a traced step before it runs, and against how it ran: costs, memory, timelines.

    compiled = step.lower(state, batch)
    report = fs.analysis.analyze(compiled)      # FLOPs per unit, collective bytes, peak memory
"""

from ._abstract import AbstractMesh as AbstractMesh
from ._abstract import abstract_state as abstract_state
from ._abstract import plan as plan
from ._analyze import Analysis as Analysis
from ._analyze import CollectiveCost as CollectiveCost
from ._analyze import UnitCost as UnitCost
from ._analyze import analyze as analyze
from ._memory import MemoryBreakdown as MemoryBreakdown
from ._memory import MemoryEstimate as MemoryEstimate

__all__ = ["AbstractMesh", "Analysis", "CollectiveCost", "MemoryBreakdown", "MemoryEstimate", "UnitCost", "abstract_state", "analyze", "plan"]
