"""The client process's side of the engine: the engine client (spawns and speaks to the worker),
the data-parallel router, the one validation of a request, and the offline Engine."""
