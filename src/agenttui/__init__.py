"""agenttui: the terminal client of agentd, and the API client library it is built on."""

from agentd import __version__ as __version__  # one distribution, one version (pyproject.toml)
