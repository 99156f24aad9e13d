"""sppo_fx: adaptive Sequence Pipeline Parallel Offloading as FX graph passes."""
from sppo_fx.errors import InfeasibleBudget, SppoError

__all__ = ["SppoError", "InfeasibleBudget"]
