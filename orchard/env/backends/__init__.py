"""Sandbox backends: where a sandbox's processes and files actually live."""
