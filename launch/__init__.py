"""The `simloop` CLI, config loading, and (later) chip planning and launchers."""
