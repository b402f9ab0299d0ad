"""One module per subcommand that runs work and writes a run directory (`collect`, `import`,
`train-sim`, `train-agent`, `eval-sim`, `eval-agent`, `rollout`, `serve`, `demo`, `e2b sweep`).
Each has `run(args, cfg) -> exit code`; `launch/cli.py` dispatches to it."""
