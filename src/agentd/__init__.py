"""agentd: a PostgreSQL-backed daemon that runs AI-agent turns durably."""

__version__ = "0.1.0"
