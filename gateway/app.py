"""The WSGI entry point: ``gunicorn 'gateway.app:create_app()'`` (what ``batchgate serve``, ``up`` and the
Dockerfile run). The application itself is built in gateway/api/app.py."""

from gateway.api.app import create_app

__all__ = ["create_app"]
