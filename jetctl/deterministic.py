"""`run.deterministic: true`: the seeds of a reproducible run, in one place.

With the flag on, a client node

* seeds every Generate request its rollouts make: `RolloutSeeds(run, node, group,
  trajectory).for_call(i)` is the OpenAI `seed` of the rollout's i-th call (calls counted in
  the order the node's proxy receives them), unless the agent gave a seed of its own;
* draws its tasks from the env's own `tasks(random.Random(task.seed + index))`, a dataset
  env's rows included (`jetctl.client.rows`): rows are not leased from the controller, so
  each node walks the whole dataset in its own seeded order.

`group` is the ordinal of the group on its node (0, 1, 2, ...: the group ids are uuid7s,
which differ from run to run) and `trajectory` the rollout's place in its group. The server's
engines honour the seed per request (hf: a `torch.Generator` of the request's own; continuous:
seeded requests go to its hf fallback); an engine not in `SEEDED_ENGINES` is refused by the
recipe while the flag is on (vllm: it takes the seed, but its replies change with the batch
they ran in). `use_deterministic_torch` is torch's deterministic mode, for a
trainer that runs with the flag.

Left out: which of a node's groups reach a step first, and so what a live run trains (nodes,
the network and the buffer race; the step rows record the order, `replay/group_ids`, and
`jetctl up --replay-from` / `jetctl replay` follow it); bitwise equal replies on a GPU under
batching (batch shapes change the kernels' sums even with a seed).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

SEEDED_ENGINES = ("hf", "continuous")  # models.<m>.engine values that honour a request's seed


def request_seed(run: str, node: str, group: int, trajectory: int, call: int) -> int:
    """The seed of one Generate request: a hash of where it comes from, in [0, 2**63) so it
    fits the int64 of the wire (swarm.proto `GenerateRequest.seed`)."""
    key = f"{run}\0{node}\0{group}\0{trajectory}\0{call}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1


@dataclass(frozen=True)
class RolloutSeeds:
    """Where one rollout sits in a deterministic run; its calls' seeds follow from it."""

    run: str  # run.name
    node: str  # the node's name (its task and index: digits-0)
    group: int  # the group's ordinal on the node
    trajectory: int  # the rollout's place in its group

    def for_call(self, call: int) -> int:
        return request_seed(self.run, self.node, self.group, self.trajectory, call)


def use_deterministic_torch() -> None:
    """torch's deterministic algorithms (an op without one raises instead of running a
    non-deterministic kernel). On CUDA, cuBLAS needs `CUBLAS_WORKSPACE_CONFIG=:4096:8` set
    before it starts; it is set here when unset, which is in time for a process that has
    not run a CUDA matmul yet."""
    import os

    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


__all__ = ["SEEDED_ENGINES", "RolloutSeeds", "request_seed", "use_deterministic_torch"]
