"""The controller of a run: lifecycle, run state, reconcile loop, swaps, Control service,
runtimes.

`controller.Controller` runs one recipe and composes `state.RunState` (what it knows),
`reconcile.Reconciler` (starting and restarting nodes) and `swap.Swapper` (rolling client
swaps); `service` is the gRPC glue (Control servicer, token check, probes of the swarm
servers); `runtimes/` start, watch, stop and list nodes (`process`, `docker`). The run
dir's files are named in `jetctl.rundir`.
"""
