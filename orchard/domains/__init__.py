"""Domains: a domain's tasks, tools, verifiers and judge prompts (SWE, GUI, Claw)."""
