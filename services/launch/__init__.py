"""Starting Tokenyard's services as child processes on one machine (`tokenyard up`, tests)."""
