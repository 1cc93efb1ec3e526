"""Runtimes: how nodes are started, watched, stopped and listed (`base.Runtime`).

`process.ProcessRuntime`: subprocesses on this host. Docker comes next.
"""
