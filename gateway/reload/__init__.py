"""The reload runtime: how the policy Sluice serves changes. `holder` (the one owner of the
serving policy: guard, then swap, rolled back when an owner fails to activate), `staging` (a
staged rollout's orchestration: candidate, ticks, promotion, abort), `rollout` (one staged
rollout's counts and verdict), `watch` (the file watcher), `guard` (the change guard) over
`traffic` (recent request shapes). The document itself is `gateway.policy`; the `sluice policy`
commands are `gateway.policyctl`.
"""
