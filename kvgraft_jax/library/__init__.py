"""Verified knowledge: external verifiers, the catalog that routes a query to one artifact, the
library directory, and the flywheel (solve, verify, deposit only what passed, graft on a hit).

Imports `core`, `store` and `exact` (and `run.config` for the settings' defaults).
"""
