"""Tools the model may call: async functions with JSON-schema parameters, run behind the fence."""

from agentd.tools.registry import Tool, ToolContext, ToolError, ToolRegistry, default_tools

__all__ = ["Tool", "ToolContext", "ToolError", "ToolRegistry", "default_tools"]
