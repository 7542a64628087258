"""The policy document SREs write: `model` (`Policy` and the checks that span it; its sections in
`base`, `auth`, `backends`, `ratelimits`, `sections`), `loader` (YAML with positions: the only
yaml import), `diagnose` (what the loader adds to pydantic's errors), `schema` (the JSON Schema
for editors), `compiled` (the frozen form the request path reads). No I/O but the loader's read.

The runtime that changes the policy Sluice serves is `gateway.reload`; the `sluice policy`
commands are `gateway.policyctl`.
"""
