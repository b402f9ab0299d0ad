"""Configuration: the root `SimloopConfig` (`schema`), the deploy sections (`deploy`), and
loading YAML plus dotted overrides into them (`loading`). Nothing here imports JAX."""

from launch.config.loading import ConfigError, build_config, dump_config, load_config, write_config

__all__ = ["ConfigError", "build_config", "dump_config", "load_config", "write_config"]
