"""Processes and commands: the CLI (up, serve, worker, supervisor, jobs, flows), child processes, the
gunicorn configuration. May import anything below it."""
