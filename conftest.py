"""Makes the repository root importable in tests (`from configs import default`)."""
