"""The job errors under their first name: they live on launch's ground floor
(`launch/errors.py`), where `deploy/` raises them too. Import them from there."""

from launch.errors import EXIT_FAILED, EXIT_USAGE, JobError, UsageError

__all__ = ["EXIT_FAILED", "EXIT_USAGE", "JobError", "UsageError"]
