"""agentrl's Hydra configs, installed as the package ``agentrl_configs``."""
