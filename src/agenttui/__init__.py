"""agenttui: the terminal client of agentd, and the API client library it is built on."""

__version__ = "0.1.0"
