"""The trajectory explorer (`jetctl view`, `jetctl trace`): a run's groups, members, steps
and lineage, read from its stores without slowing them (jetctl.view.stores), served as
server-rendered pages (jetctl.view.app, jetctl.view.pages)."""
