"""The main command's Hydra configs (YAML), shipped inside the package: `pkg://etdist.bench.conf`."""
