"""The refusal every service raises (a message that says what to fix)."""


class ServiceError(Exception):
    """A refusal whose message says what to fix."""
