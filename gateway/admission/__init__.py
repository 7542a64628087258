"""Fair admission: the queue of each backend pool and its tenants, kept in the services."""
