"""The data plane and its entry points: the configuration tree and the one start-up path, the router (dense model,
dispatch of tokens to expert actors, transports), continuous batching, the Serve deployment and gRPC front, and the
Python API (`mesh.ExpertMesh`)."""
