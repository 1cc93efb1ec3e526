"""`jetctl images build`: the client images of `images/` (base + one per task family).

    jetctl images build                      # all, FROM python:3.11-slim (needs a registry)
    jetctl images build --offline-base       # FROM a local Debian (debootstrap + docker import)
    jetctl images build web --offline-base   # the base and jetctl-web
    jetctl images list                       # the families and whether each image is built

The logic (wheelhouse, debootstrap, docker build) lives in `jetctl.controller.runtimes.images`.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from jetctl.cli.errors import fail

app = typer.Typer(help="Build the client images (images/).", no_args_is_help=True)


@app.command("build")
def build(
    families: Annotated[
        list[str] | None, typer.Argument(help="Families to build (default: all); base always.")
    ] = None,
    offline_base: Annotated[
        bool,
        typer.Option(
            "--offline-base", help="Build FROM a Debian made here (debootstrap), no registry."
        ),
    ] = False,
    base: Annotated[
        str | None,
        typer.Option("--base", help="Image the base builds FROM (default python:3.11-slim)."),
    ] = None,
    rebuild_base: Annotated[
        bool, typer.Option("--rebuild-base", help="Make the offline base again even if it exists.")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Print every build line.")
    ] = False,
) -> None:
    """Build jetctl-base and jetctl-<family> for every images/<family>/Dockerfile."""
    from jetctl.controller.runtimes.docker import RuntimeUnavailable
    from jetctl.controller.runtimes.images import ImageBuildError, build_images

    if offline_base and base:
        fail("pass --offline-base or --base IMAGE, not both")
    console = Console()
    with console.status("building images…") as status:

        def say(line: str) -> None:
            if line.startswith("  "):
                status.update(f"[dim]{line.strip()[:100]}[/dim]")
                if verbose:
                    console.print(line, highlight=False, markup=False)
            else:
                console.print(f"[bold]•[/bold] {line}", highlight=False)
                status.update(line)

        try:
            tags = build_images(
                families or [],
                offline_base=offline_base,
                base=base,
                rebuild_base=rebuild_base,
                say=say,
            )
        except (ImageBuildError, RuntimeUnavailable) as e:
            fail(str(e))
    console.print(f"built: {', '.join(tags)}")


@app.command("list")
def list_images() -> None:
    """The image families in images/ and whether each is built."""
    from jetctl.controller.runtimes.docker import RuntimeUnavailable, docker_client
    from jetctl.controller.runtimes.images import ImageBuildError, families

    try:
        fams = families()
        client = docker_client()
    except (ImageBuildError, RuntimeUnavailable) as e:
        fail(str(e))
    for f in fams:
        names = {t for img in client.images.list(name=f.tag) for t in img.tags}
        typer.echo(f"{f.tag:<16} {'built' if names else 'not built'}  ({f.dockerfile})")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="images")
