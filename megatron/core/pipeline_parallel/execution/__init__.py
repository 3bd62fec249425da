"""Torch execution of a planned pipeline: interpreter, transports, reducers, model chunks, runtime."""
