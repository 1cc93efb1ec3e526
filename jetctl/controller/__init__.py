"""The controller of a run: reconcile loop, run dir, Control service, runtimes.

`controller.Controller` runs one recipe; `rundir` knows the run dir's files and finds runs;
`service` is the gRPC glue (Control servicer, token check, probes of the swarm servers);
`runtimes/` start, watch, stop and list nodes (`process` now, `docker` next).
"""
