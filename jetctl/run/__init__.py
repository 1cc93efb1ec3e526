"""The run-level tools: what reads (or drives) a whole run directory, above the nodes.

`status`: the live view of a run, asked of its controller (`jetctl status`, the `jetctl up`
view). `ledger`: where every trajectory id ended up, from the spools, the stores and the
controller's received files, and whether the books balance. `plot`: the reward curves, from
the step logs. `chaos`: a run trained while faults happen, then quiesced and balanced
(`jetctl chaos`, tests/faults/).

Nothing under `jetctl.server`, `jetctl.client` or the root's foundations imports these: they
read the files those write (`jetctl.rundir` names them).
"""
