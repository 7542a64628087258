"""JWT authentication: token verification (`jwt`), key sets (`keys`), their caches (`jwks`) and
the verified-token cache (`tokens`)."""
