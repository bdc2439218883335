"""The gRPC front end: ``prefixgate.v1.Gateway`` for clients that speak gRPC."""
