"""Screens: the chat, and the modal ones (help, search, rename)."""
