"""Pipeline schedules: plain data shared by the solver, the simulator and the runtime.

docs/architecture.md, section 4 "Schedule grammar". One job per module:

    actions.py     Action, ActionKind, Schedule: the grammar, text and JSON forms
    validate.py    validate(): structure (dependencies, matching, deadlock) and memory
    generators.py  GPipe and chunk-level 1F1B, insert_communication, with_offload
    simulator.py   simulate(): the one clock (time, bubbles, memory timeline)
    simdata.py     ActionCosts (its input), SimResult / SimEvent (its output)

This package imports nothing else of sppo_fx but `errors`, so `runtime` and `solver` both
sit above it.
"""
from sppo_fx.schedule.actions import Action, ActionKind, Schedule, ScheduleError
from sppo_fx.schedule.generators import (SCHEDULE_KINDS, build_schedule, gpipe_compute_order, gpipe_schedule,
                                         insert_communication, one_f_one_b_compute_order, one_f_one_b_schedule,
                                         one_f_one_b_warmup, predicted_peak_inflight, with_offload)
from sppo_fx.schedule.simdata import ActionCosts, SimEvent, SimResult
from sppo_fx.schedule.simulator import simulate
from sppo_fx.schedule.validate import ValidationReport, validate

__all__ = [
    "ActionKind", "Action", "Schedule", "ScheduleError", "ValidationReport", "validate",
    "gpipe_schedule", "one_f_one_b_schedule", "gpipe_compute_order", "one_f_one_b_compute_order",
    "one_f_one_b_warmup", "insert_communication", "with_offload", "predicted_peak_inflight",
    "build_schedule", "SCHEDULE_KINDS", "ActionCosts", "SimEvent", "SimResult", "simulate",
]
