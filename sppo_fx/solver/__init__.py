"""The solver: device profiles (and, later, the budget solver, partitioner, simulator)."""
from sppo_fx.solver.profiles import PROFILES, DeviceProfile, calibrate, get_profile, profiles_table

__all__ = ["DeviceProfile", "PROFILES", "get_profile", "calibrate", "profiles_table"]
