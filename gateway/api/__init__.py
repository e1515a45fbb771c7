"""The HTTP edge: the app factory and its error mapping, one blueprint per resource, the OpenAPI
document, Idempotency-Key replay. Imports push, the ledger, net and the ground."""
