"""agentd's HTTP surface (aiohttp): handlers call the service layer, never SQL directly."""
