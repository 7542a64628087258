"""The policy: the document SREs write, and the runtime that changes the one Sluice serves.

- the document: `model` (`Policy` and the checks that span it; its sections in `base`, `auth`,
  `backends`, `ratelimits`, `sections`), `loader` (YAML with positions: the only yaml import),
  `diagnose` (what the loader adds to pydantic's errors), `schema` (the JSON Schema for
  editors), `compiled` (the frozen form the request path reads). No I/O but the loader's read.
- the reload runtime: `holder` (the one owner of the serving policy: guard, stage, swap),
  `watch` (the file watcher), `guard` (the change guard) over `traffic` (recent request
  shapes), `rollout` (one staged rollout).
- the CLI: `commands` (`sluice policy ...`), `remote` (the commands that talk to a running
  gateway's admin API).
"""
