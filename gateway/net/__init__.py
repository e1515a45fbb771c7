"""Every outbound request: the URL guard, the guarded session, and pooled connections that do not go
stale (keepalive). Imports the ground only."""
