"""Where shared limit state lives: the in-process memory twin and Redis (Lua scripts)."""
