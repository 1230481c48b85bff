"""`python -m pipeline COMMAND …`: the `pipeline` command, as `python -m pipeline.cli` (the module the launch lines
in README.md name) and the installed script, for an environment whose scripts folder is not on PATH."""

from pipeline.cli import main

if __name__ == "__main__":  # pragma: no cover
    main()
