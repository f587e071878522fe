"""How to train on a device: every decision with its reason, the memory model, the search, `plan()`, exports."""
