"""`python -m jetctl.recipe --write-docs docs/recipe.md`: rewrite the field reference of
docs/recipe.md between its marks (reference.py); without arguments, print it."""

from __future__ import annotations

import sys
from pathlib import Path

from jetctl.recipe.reference import reference_markdown, write_reference

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write-docs":
        write_reference(Path(sys.argv[2]))
    else:
        sys.stdout.write(reference_markdown())
