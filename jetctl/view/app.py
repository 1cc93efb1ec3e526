"""The explorer's web app (FastAPI): HTML pages and the same answers as JSON.

    app = make_app(Path("runs/tiny"), token=None)      # loopback: no credential
    uvicorn.run(app, host="127.0.0.1", port=8765)

Pages: `/` (per model and task: reward curve, fates, staleness; the filtered group list),
`/group/{model}/{id}`, `/step/{model}/{step}`, `/trace/{trajectory_id}`; JSON under `/api/`.
With a `token` every request needs the run's credential: `Authorization: Bearer <token>`,
or `?token=<token>` once (it is kept in a cookie for the session).
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import HTMLResponse, PlainTextResponse

from jetctl.view import pages
from jetctl.view.stores import Fate, GroupFilter, RunView

COOKIE = "jetctl_view_token"


def _filter(
    model: str | None, task: str | None, fate: str | None, revision: str | None,
    reward_min: str | None, reward_max: str | None, version_min: str | None,
    version_max: str | None, search: str | None, limit: int,
) -> GroupFilter:
    """A GroupFilter from query parameters (an empty form field means: any)."""

    def num(name: str, v: str | None, kind: type[float | int]) -> Any:
        if v is None or not v.strip():
            return None
        try:
            return kind(v)
        except ValueError:
            raise HTTPException(400, f"{name}={v!r} is not a number") from None

    if fate and fate not in ("trained", "buffered", "stale", "invalid", "revision"):
        raise HTTPException(400, f"fate={fate!r}: one of trained, buffered, stale, invalid, "
                                 "revision")
    chosen: Fate | None = fate or None  # type: ignore[assignment]  # checked just above
    return GroupFilter(
        model=model or None, task=task or None, fate=chosen, revision=revision or None,
        reward_min=num("reward_min", reward_min, float),
        reward_max=num("reward_max", reward_max, float),
        version_min=num("version_min", version_min, int),
        version_max=num("version_max", version_max, int),
        search=search or None, limit=limit,
    )


def make_app(run_dir: Path, token: str | None) -> FastAPI:
    """The explorer of `run_dir`; `token` (the run's credential) is required of every
    request when given (a bind other than loopback)."""
    run = RunView(run_dir)
    app = FastAPI(title="jetctl view", docs_url=None, redoc_url=None, openapi_url=None)

    if token is not None:
        @app.middleware("http")
        async def credential(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
            given = (request.headers.get("authorization", "").removeprefix("Bearer ")
                     or request.query_params.get("token") or request.cookies.get(COOKIE) or "")
            if not secrets.compare_digest(given.encode(), token.encode()):
                return PlainTextResponse("the run's token is required (Authorization: Bearer, "
                                         "or ?token=)", status_code=401)
            response = await call_next(request)
            if request.query_params.get("token"):
                response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
            return response

    def server_version(model: str) -> int | None:
        steps = run.steps(model)
        return int(steps[-1]["step"]) if steps else None

    @app.get("/", response_class=HTMLResponse)
    def index(
        model: str | None = None, task: str | None = None, fate: str | None = None,
        revision: str | None = None, reward_min: str | None = None,
        reward_max: str | None = None, version_min: str | None = None,
        version_max: str | None = None, search: str | None = None,
        limit: int = Query(100, ge=1, le=500),
    ) -> str:
        f = _filter(model, task, fate, revision, reward_min, reward_max, version_min,
                    version_max, search, limit)
        views = [run.overview(m) for m in run.models()]
        body = pages.overview(views, run.groups(f), f, run.tasks())
        return pages.page(f"jetctl view: {run.paths.root.name}", body)

    @app.get("/group/{model}/{group_id}", response_class=HTMLResponse)
    def group(model: str, group_id: str) -> str:
        g = run.group(model, group_id)
        if g is None:
            raise HTTPException(404, f"no group {group_id} in {model}'s store")
        version = server_version(model)
        lag_now = None if version is None else version - g.row.min_version
        return pages.page(f"group {group_id}", pages.group_page(g, run.texts(model), lag_now))

    @app.get("/step/{model}/{step}", response_class=HTMLResponse)
    def step(model: str, step: int) -> str:
        trained = run.groups(GroupFilter(model=model, step=step, limit=500))
        return pages.page(f"{model} step {step}",
                          pages.step_page(model, step, run.step_row(model, step), trained))

    @app.get("/trace/{trajectory_id}", response_class=HTMLResponse)
    def trace(trajectory_id: str) -> str:
        return pages.page(f"trajectory {trajectory_id}", pages.trace_page(run.trace(trajectory_id)))

    @app.get("/api/groups")
    def api_groups(
        model: str | None = None, task: str | None = None, fate: str | None = None,
        revision: str | None = None, reward_min: str | None = None,
        reward_max: str | None = None, version_min: str | None = None,
        version_max: str | None = None, search: str | None = None, step: int | None = None,
        limit: int = Query(100, ge=1, le=500),
    ) -> list[dict[str, Any]]:
        f = _filter(model, task, fate, revision, reward_min, reward_max, version_min,
                    version_max, search, limit)
        if step is not None:
            f = GroupFilter(**{**vars(f), "step": step})
        return [g.json() for g in run.groups(f)]

    @app.get("/api/group/{model}/{group_id}")
    def api_group(model: str, group_id: str) -> dict[str, Any]:
        g = run.group(model, group_id)
        if g is None:
            raise HTTPException(404, f"no group {group_id} in {model}'s store")
        members = [
            {"id": m.trajectory.id, "reward": m.trajectory.reward, "advantage": m.advantage,
             "trained": m.trained, "status": m.trajectory.status, "node": m.trajectory.client_id,
             "revision": m.trajectory.client_revision,
             "turns": [{"version": c.model_version, "completion_tokens": len(c.completion_ids),
                        "logprobs": list(c.completion_logprobs),
                        "finish_reason": c.finish_reason} for c in m.trajectory.calls]}
            for m in g.members
        ]
        return {**g.row.json(), "zero_variance": g.zero_variance,
                "advantage_name": g.advantage_name, "members": members,
                "payload_dropped": g.group is None}

    @app.get("/api/overview/{model}")
    def api_overview(model: str) -> dict[str, Any]:
        if model not in run.models():
            raise HTTPException(404, f"no store for model {model}")
        return run.overview(model)

    @app.get("/api/trace/{trajectory_id}")
    def api_trace(trajectory_id: str) -> dict[str, Any]:
        return run.trace(trajectory_id).json()

    return app
