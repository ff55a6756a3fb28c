"""Agent programs (entry point group ``agentrl.agents``) that know nothing of agentrl."""
