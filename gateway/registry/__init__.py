"""Backend members and their live state: the pool owner in the services (`pool`), the member
state it keeps (`member`), one backend section's view over it (`view`) and its settings as the
pure cores take them (`params`), members from Redis heartbeats (`heartbeats`), active health
checks (`health`), model discovery (`models`), the Prometheus gauges (`collector`) and the
`sluice heartbeat` agent (`agent`). The Redis client they share is `gateway.store.redis_client`."""
