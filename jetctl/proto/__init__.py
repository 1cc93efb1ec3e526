"""Wire protocol: swarm.proto (clients -> servers) and control.proto (CLI -> controller).

Generated code lives in _gen/ (made by scripts/gen_proto.py); convert.py maps it to the
dataclasses in jetctl.types.
"""
