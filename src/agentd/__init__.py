"""agentd: a PostgreSQL-backed daemon that runs AI-agent turns durably."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("agentd")  # pyproject.toml's version: the one place it is written
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"
