"""Environments that ship with jetctl (`jetctl.envs.dataset`: tasks from a dataset file)."""
