"""Configuration: the pydantic schema (defaults live there) and Hydra composition."""

from agentrl.config.loader import compose, config_dir, load_config, validate_config
from agentrl.config.schema import TrainConfig

__all__ = ["TrainConfig", "compose", "config_dir", "load_config", "validate_config"]
