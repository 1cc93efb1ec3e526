"""Answer a question from a REST API that needs credentials and enforces a rate limit.

Each session serves its own JSON service (`envs/api/service.py`: stdlib http.server in a
thread on 127.0.0.1; users, their orders in pages of 3, order items, and POST /v1/answers).
Tasks need several calls: find the user by name, page through their orders, read each
order, compute, then submit, e.g. "the total in cents of Ada Moreau's shipped orders" or
"how many units of Gadget has Ada Moreau ordered (orders not cancelled)".

The session's tool is `http(method, path, body=None)` (text for the model; `request()`
returns status, body, Retry-After): it adds `Authorization: Bearer <api_key>` itself, so
the model never sees the credential, and accepts paths on the service only, so the
credential goes nowhere else. Past `burst` requests (refilled at `rate_per_s`) the service
answers 429 with `Retry-After`; `http` waits that long and retries (at most
`max_retries_429` times) and says it waited.

Credentials: `api_key` comes from env_args, in a recipe as `api_key: ${JET_API_KEY}`; it is
held in a `Secret` (repr `Secret('***')`), never logged (the `envs.api` logger writes method,
path and status only), never echoed by the service, and never put in error text.
None makes a random key per env.

Levels (`level`, envs/levels.py):

* `hard` (default): the questions above, the `http` tool, 16 model calls. Reward, from the
  answers the service holds: 1.0 if the first answer submitted for this task id equals the
  right integer, else 0.0.
* `easy`: fetch one named resource ("Fetch the orders of user u105: GET /v1/users/<user
  id>/orders. Call get.": an order, a user, or a user's orders, the task naming its
  endpoint with a placeholder the model fills in), one `get(path)` call, after a prior
  exchange (fetching another order, and the get call that does it). Task score, from the
  service's own record of what it served: 1.0 if it answered 200 to a GET of the
  resource's path; reward 0.2 for a well-formed get + 0.8 * that. The
  credential and the rate limit are the same as at the hard level.

Run: `make_env(api_key=None, seed=0, rate_per_s=5.0, burst=5, max_retries_429=3,
level="hard", log_actions=False)`, agent `agents.api:agent`.
Left out: calling a real external API (the service is always the env's own), OAuth flows,
partial credit at the hard level.
"""

from __future__ import annotations

from envs.api.env import ApiEnv, ApiSession, ApiToolError, HttpReply, make_env
from envs.api.service import ApiServer, ApiState, RateLimiter, Secret, make_dataset

__all__ = [
    "ApiEnv",
    "ApiServer",
    "ApiSession",
    "ApiState",
    "ApiToolError",
    "HttpReply",
    "RateLimiter",
    "Secret",
    "make_dataset",
    "make_env",
]
