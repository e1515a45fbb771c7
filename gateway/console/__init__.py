"""The web console at ``/console``: server-rendered pages over the same services as the API, for people.

``views.bp`` is the blueprint the app factory registers. Sessions and CSRF: sessions.py and auth.py;
job pages and actions: jobs.py; the approvals inbox: approvals.py; templates under templates/console,
one stylesheet and one small script under static (no build step, no CDN).
"""
