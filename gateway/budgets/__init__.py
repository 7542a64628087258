"""Token budgets: the compiled rules, their one owner in the services, the shared store."""
