"""Units: a block's flat, padded parameters, their layout on this rank, unshard / reshard and the flat gradient
(unit.py); the side record of each parameter (sharded_param.py)."""
