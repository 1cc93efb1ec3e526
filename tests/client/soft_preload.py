"""A module a node names for its forkserver to try (a dataset task's reward module):
test_rollout_pool.py checks that a rollout finds it loaded already."""

LOADED = True
