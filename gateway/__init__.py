"""The HTTP API and web dashboard: a gateway that maps HTTP onto the command subjects.
What it may reach and decide: docs/architecture.md#folders; the API: docs/api-http.md.
"""
