"""Widgets of the chat screen, one module per area."""
