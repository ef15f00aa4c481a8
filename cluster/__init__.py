"""Control plane: placement of expert actors, naming, and (later) the controller and its pure policies."""
