"""The SWE domain: repository tasks in the SWE-bench schema (`instances`), a seeded toy generator (`generator`),
sandboxes and the reward (`sandbox`), and the teacher's value-estimation and process-reward prompts (`prompts`)."""
