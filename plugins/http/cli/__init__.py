"""Command-line tools registered as ``superfluid`` subcommands: clients of a server or of its
files, not part of the server's routes."""
