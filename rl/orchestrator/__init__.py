"""The asyncio orchestrator: episodes (token-in/token-out), arms, groups, admission with a
staleness bound, rollout metrics and trajectory storage."""
