"""What survives a restart: the journal, the snapshot and its recovery."""
