"""The SWE domain: repository tasks in the SWE-bench schema, a seeded toy generator, sandboxes and the reward."""
