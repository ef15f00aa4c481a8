"""Router: dense model, gating, dispatch of tokens to expert actors, and the Python serving API."""
