"""JWT authentication: token verification (`jwt`), key sets (`keys`) and their caches (`jwks`)."""
