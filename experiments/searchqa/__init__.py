"""Research probes: see the README.md of this folder."""
