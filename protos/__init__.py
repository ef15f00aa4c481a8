"""Protocol definitions and the generated gRPC package."""
