"""What the machine is: `Device` and the capability table, the probe, GPU profiles, measurements, torch wheels."""
