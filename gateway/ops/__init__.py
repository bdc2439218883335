"""The gateway as processes and commands: the server, the local stack, the admin CLI, smg flags."""
