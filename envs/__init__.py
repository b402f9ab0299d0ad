"""Shells (local, E2B, simulated), the terminal env, task suites, rewards and fidelity metrics
(docs/architecture.md §3).

- `envs.shell`: the `Shell` protocol, `Observation`, `TaskSetup`, output capping.
- `envs.local` (`LocalShell`), `envs.e2b` (`E2BShell`, `sweep`), `envs.simulated`
  (`SimulatedShell`, `CompletionClient`): the three backends.
- `rl.data.sim_format`: the simulator's prompt and observation format (shared with its SFT data).
- `envs.terminal`: `TerminalEnv` (action parsing, observation format, limits).
- `envs.tasks` (`Task`, JSONL), `envs.rewards` (registry), `envs.textops`, `envs.swe`.
- `envs.fidelity`: simulated-vs-real and hygiene metrics.
- `envs.config`: the frozen configs of all of the above (no JAX, no e2b import).
"""
