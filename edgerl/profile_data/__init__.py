"""GPU profiles as TOML data files (installed as ``edgerl.profile_data``)."""
