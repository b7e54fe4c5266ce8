"""What every tier shares: daemons, databases, SSE, the journal checks and test data."""
