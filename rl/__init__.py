"""Models, data and training for simloop: `rl.model`, `rl.data`, `rl.train`, `rl.orchestrator`."""
