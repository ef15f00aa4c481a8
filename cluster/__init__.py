"""Control plane: actor naming and slots, the routing table and its store, the controller actor, and the pure
policies it runs (circuit breaker, load statistics, shard placement planner, autoscaling, elastic control step)."""
