"""One module per CLI command (thin wrappers: parse flags, load config, call the stage)."""
