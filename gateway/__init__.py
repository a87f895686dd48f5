"""The HTTP API and web dashboard: a gateway that maps HTTP onto the command subjects.

It speaks NATS only through client/ (as each caller's own NATS user) and reads the fleet views
through projections/; nothing here decides anything the command service would not.
"""
