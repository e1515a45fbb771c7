"""State in Redis and nothing else: the ledger's records, keys, Lua scripts, control actions, flows
and jobs; the planner beside it reads sources without touching Redis. Imports net and the ground only."""
