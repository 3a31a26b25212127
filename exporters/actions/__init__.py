"""What the agent does about a finding besides reporting it: drain the node in Slurm, run a
hook. Like an exporter, an action is a sink: it sees the runtime only as a SinkContext."""
