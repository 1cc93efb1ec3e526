"""The run-level tools: what reads (or drives) a whole run directory, above the nodes.

`status`: the live view of a run, asked of its controller (`jetctl status`, the `jetctl up`
view). `ledger`: where every trajectory id ended up, from the spools, the stores and the
controller's received files, and whether the books balance. `chaos`: a run trained while
faults happen, then quiesced and balanced (`jetctl chaos`, tests/faults/). `eval`: a
checkpoint scored on a dataset task's rows (`jetctl eval`). `export`: a checkpoint as a
merged Hugging Face folder (`jetctl export`). `replay`: one recorded step rebuilt and compared
bit for bit, and its portable bundle (`jetctl replay`, `jetctl bundle`). `rerun`: a run
re-trained from its recorded groups (`jetctl up --replay-from`).

Nothing under `jetctl.server`, `jetctl.client`, `jetctl.controller` or the root's foundations
imports these (tests/test_layers.py): they read the files those write (`jetctl.rundir` names
them), and may import any of them. The reward curve the controller draws during a run is
the controller's (`jetctl.controller.plot`); a run's checkpoints are loaded by
`jetctl.server.trained`.
"""
