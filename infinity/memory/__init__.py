"""The memory model: tiers, the placement plan, its cost, and the manager that moves the bytes."""
