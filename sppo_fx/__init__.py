"""sppo_fx: adaptive Sequence Pipeline Parallel Offloading as FX graph passes.

Public surface: `compile` (function and decorator forms), `Plan`, and the errors.
"""
from sppo_fx.api import SppoCompiled, compile
from sppo_fx.errors import InfeasibleBudget, SppoError
from sppo_fx.markers import split_point
from sppo_fx.plan import Plan

__all__ = ["compile", "SppoCompiled", "Plan", "SppoError", "InfeasibleBudget", "split_point"]
