"""The client node: rollouts of agents in killable processes, an OpenAI-compatible proxy that
records token timelines, a durable spool and the gRPC transport to the model's server.

Entry point: `jetctl client ...` (jetctl/cli/client.py) -> `jetctl.client.node.ClientNode`.
"""
