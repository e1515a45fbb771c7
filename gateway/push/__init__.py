"""Calls to platforms: one stage attempt (dispatch), the worker's feeder and call threads, and the
supervisor that expires dead leases. Imports the ledger, net and the ground."""
