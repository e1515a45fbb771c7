"""Platform connectors (n8n, Dify, Coze, generic HTTP) for push mode; no Flask, no RQ."""
