"""The baseline endpoint pair for bench_http_step.py: a Flask app whose POST /set stores a value and
GET /get reads it back, on BATCHGATE_BENCH_REDIS_URL, served by gunicorn exactly as batchgate's API is."""

from __future__ import annotations

import os

import redis
from flask import Flask, jsonify, request


def create_app() -> Flask:
    app = Flask(__name__)
    r = redis.Redis.from_url(os.environ["BATCHGATE_BENCH_REDIS_URL"], decode_responses=True)

    @app.post("/set")
    def set_value():
        r.set("bench:setget", request.get_json()["value"])
        return jsonify({"ok": True})

    @app.get("/get")
    def get_value():
        return jsonify({"value": r.get("bench:setget")})

    return app
