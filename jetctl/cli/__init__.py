"""Thin typer entry points, one module per command group; logic lives in jetctl/."""
