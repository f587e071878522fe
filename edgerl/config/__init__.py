"""The run config: typed sections with documentation and ranges, and its loading from TOML and --set."""
