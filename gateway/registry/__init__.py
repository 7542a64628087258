"""Backend members and their live state: the pool owner in the services (`pool`), members from
Redis heartbeats (`heartbeats`), active health checks (`health`), the shared Redis client
(`redis`) and the `sluice heartbeat` agent (`agent`)."""
