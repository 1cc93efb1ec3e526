"""Runtimes: how nodes are started, watched, stopped and listed (`base.Runtime`).

`process.ProcessRuntime`: subprocesses on this host. `docker.DockerRuntime`: one container
per client node (the `docker` SDK; `pip install 'jetctl[docker]'`), imported only when a
task asks for `runtime: docker`. `images`: the builder of the client images that runtime
starts (`jetctl images build`).
"""
