"""Backend members and their live state: the pool owner in the services (`pool`), the member
state it keeps (`member`), one backend section's view over it (`view`), members from Redis
heartbeats (`heartbeats`), active health checks (`health`), the shared Redis client (`redis`),
the Prometheus gauges (`collector`) and the `sluice heartbeat` agent (`agent`)."""
