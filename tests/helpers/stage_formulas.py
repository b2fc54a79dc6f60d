"""The seeds' per-rank byte formulas of the ZeRO stages (issue 23), shared by the layout, memory and estimate tests."""

# bf16 parameters (2), fp32 gradients (4), K = 12, written out independently of infinity's own byte model.
FORMULAS = {
    0: lambda psi, n: (2 + 4 + 12) * psi,
    1: lambda psi, n: (2 + 4) * psi + 12 * psi / n,
    2: lambda psi, n: 2 * psi + (4 + 12) * psi / n,
    3: lambda psi, n: (2 + 4 + 12) * psi / n,
}
