"""Shells (local, E2B, simulated), the terminal env, task suites, rewards and fidelity metrics
(DESIGN.md §3)."""
