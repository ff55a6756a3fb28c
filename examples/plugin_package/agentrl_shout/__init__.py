"""agentrl example plugins: a model is asked to say words, and must say them in capitals."""
