"""Kernel backends of fp4vis, one subpackage each (``hopper``: sm_90a, CuTe DSL). The backend
registry (``fp4vis.backends.registry``) loads a subpackage's ``backend`` module on first use."""
