"""The orchestrator: what `sppo_fx.compile`'s first call does, in order, for one stage
(`stage.py`) and for the ranks of a (pp, dp, sp) layout (`ranks.py`):

    capture -> graph passes -> cost model -> solve -> codegen -> product

The options were checked before (`options.compile_options`). The product
(`runtime.product`) is plain data the runtime only runs. docs/architecture.md, section 1.
"""
from sppo_fx.orchestrate.ranks import RankBuild, build_rank
from sppo_fx.orchestrate.stage import Entry, chunk_plan, compile_chunk, plan_call, prepare, stage_product

__all__ = ["Entry", "RankBuild", "build_rank", "chunk_plan", "compile_chunk", "plan_call", "prepare",
           "stage_product"]
