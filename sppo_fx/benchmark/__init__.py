"""The benchmark engine of `sppo-fx bench` and `bench/memory.py` (one engine, thin front ends).

- `config`: a row (anchor or library configuration), the axes, the grid, --only/--skip;
- `worker`: one row in its own process, measured;
- `engine`: rounds, interleaving, combining, paired ratios with the "–" rule;
- `report`: table, JSON/CSV records, machine and commit, `--compare`;
- `plot`: the Pareto picture (matplotlib: PNG, SVG; and a text plot);
- `cli`: the `sppo-fx bench` command.
"""
from sppo_fx.benchmark.config import BenchConfig, build_grid, resolve_budget
from sppo_fx.benchmark.engine import add_ratios, run_grid

__all__ = ["BenchConfig", "add_ratios", "build_grid", "resolve_budget", "run_grid"]
