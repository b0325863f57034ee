"""Process plumbing shared by the engine core and the executors (start, stop, exit with the parent, ipc dir)."""
