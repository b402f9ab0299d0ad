"""Training: one jitted, sharded train step per role on its sub-mesh (`trainer`), losses,
optimizer, Orbax checkpoints, building a role's trainer from config (`build`), and the SFT and RL
loops (`loop`). Imports rl/model and rl/data only; never serving (docs/architecture.md §3)."""
