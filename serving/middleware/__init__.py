"""`simloop middleware`: Anthropic Messages and OpenAI chat in front of an agent server, with
token-exact trajectories per rollout (docs/architecture.md §9). `formats` reads and writes the
two APIs, `chain` keeps each rollout's segments, `app` serves them over HTTP."""
