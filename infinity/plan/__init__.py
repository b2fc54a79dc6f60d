"""The estimator and planner: the traced model, the byte and time prediction of a job, the plan search, the
table of placements and stages, the largest model that fits, the scaling paper."""
