"""One module per command of the command line; each has `add_arguments` and `main`."""
