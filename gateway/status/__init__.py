"""The status page (`/status`) and the one JSON document it reads (`/admin/state`).

`/status` serves static files shipped in this package (index.html, status.css, status.js: no
CDN, no build step); the script fetches `/admin/state` every few seconds and renders it, colour
first, worst first, a unit on every number. `sluice status` prints the same document in a
terminal. Under `--workers N` each answer comes from one worker (its `gateway.pid`); counters
(rejections, upstream errors) are summed over all workers.

The document (`gateway.status.state.StatusBoard.state`). Keys a feature does not provide are absent,
and the page renders a section only when its key is there. Every number carries its unit in
its key: `_s` seconds, `_ms` milliseconds, `_bytes` bytes, `_util` / `pressure` / `load` a
fraction of capacity (0..1, shown as %), counts are plain (`in_flight`, `connections`,
`errors`). `t` and `*_at` are Unix times in seconds.

    colour      "green" | "yellow" | "red"   worst of everything below (gateway.core.status)
    reasons     ["backend sim-grpc: 1 of 2 members down", ...]   worst first
    history     [{t, colour}]                the gateway colour every 5 s, last 15 min
    series      {step_s, t, backends: {name: {rps, p99_ms, ttft_p99_ms}}, queues: {pool: [..]},
                 tenants: {tenant: [share]}}   the charts' points (gateway.status.series)
    gateway     {state: "starting"|"ready"|"draining", pid, version, uptime_s, in_flight,
                 listeners: [{name, host, port}]}
    policy      {version, path, loaded_at, reloads, last_reload: {ok, at, errors: [..]},
                 last_error: {at, errors}}
    routes      [{name, protocol, path_prefix, backends: [..]}]
    backends    {backends: [{name, protocol, colour, recent_errors, errors: {kind: count},
                 members: [{address, weight, colour, healthy, load, in_flight, breaker,
                 ejected, connections, idle, waiting, channel}]}]}
    rejections  {window_s, recent: {reason: count}, total: {reason: count}}
    datapath    {state: "off"|"attached"|"unavailable", interface, required, error, ...}

Long-lived feature owners add their own sections through `Services.state()` (the owner's
`state()`), merged in under their services key: a dict merges into a dict key by key, a list of
dicts merges into a list of dicts item by item matched on `name` (or `address`; a dict of dicts
`{name: {...}}` counts as such a list), anything else replaces. The shapes the page knows how
to show best:

    limits      {colour, history: [{t, colour}], rules: [{name, qps_util, token_util,
    (ratelimit)  pressure, colour}], rejections: {reason: count}}
    backends    {backends: [{name, members: [{address, healthy, load, in_flight,
                 breaker: "closed"|"open"|"half_open", ejected}]}]}
    rollout     {colour, stage, version, candidate, ...}

Also understood: `backends: {name: {members: [...]}}`; per member the detectors' snapshots
`health: {healthy}`, `breaker: {state}`, `outlier: {ejected_for_s}` (flat `healthy` and
`ejected` are derived from them); a colour history as `[[seconds_ago, colour], ...]` or as a
dict of such lists (one strip each). Any other section shows generically: a `colour` field as
a badge, lists of dicts as tables (rows with a worse `colour` first, a row's own lists as
tables after it), other values as a key/value table.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

ASSETS = ("index.html", "status.css", "status.js")
CONTENT_TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript"}


def asset(name: str) -> tuple[bytes, str]:
    """The bytes and content type of one shipped page file (name from ASSETS)."""
    data = (files("gateway.status") / name).read_bytes()
    return data, CONTENT_TYPES[Path(name).suffix]
