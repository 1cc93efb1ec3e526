"""RL losses, one file each (GRPO now; RLOO, REINFORCE later). They share data types, not classes."""
