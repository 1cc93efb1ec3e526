"""jetctl: reinforcement learning for LLM agents on a swarm.

Swarm servers own trainable models and optimize them; client nodes run agents in their
own task environments and stream trajectories back. See docs/architecture.md.
"""

__version__ = "0.1.0"
