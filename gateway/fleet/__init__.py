"""What the replicas of one fleet share through the store: its one connection owner
(`gateway.fleet.store`), the backend slots leased per pool (`gateway.fleet.slots`)."""
