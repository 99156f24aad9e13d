"""The solver: device profiles (`profiles`, `calibration`, `profile_cache`), the budget solver (`budget`),
the chunk partitioner (`partition`), the pipeline chunk solver (`pipeline`) and the
layout predictions (`layout`, `predict`). The package exports the
device profiles; import the rest from their modules."""
from sppo_fx.solver.calibration import calibrate
from sppo_fx.solver.profiles import PROFILES, DeviceProfile, get_profile, profiles_table

__all__ = ["DeviceProfile", "PROFILES", "get_profile", "calibrate", "profiles_table"]
