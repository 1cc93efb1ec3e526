"""A module that fails at import with something other than ImportError: a forkserver that
tries it must survive it (test_rollout_pool.py)."""

raise RuntimeError("this reward module is broken")
