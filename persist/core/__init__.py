"""The sans-I/O core of persist: shard state, its transitions and encodings, Arrow kernels.

Nothing here awaits, sleeps, reads a clock, makes ids or touches a location.
"""
