"""The top layer: the command line, its commands, diagnosis, the watcher and the registry."""
