"""The runtime of a training step: the engine and `initialize` (engine.py), materializing units (materialize.py),
hooks, prefetch, activations, gradient reduction, the update modes and the fp16 loss scale."""
