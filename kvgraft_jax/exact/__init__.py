"""The exactness protocol: deposit a prefix with a recorded chunk schedule, graft it back at its
own positions, and prove the continuation bit-identical to a recompute of the same program
(`contract` says which recompute that is).

Imports `core` and `store`.
"""
