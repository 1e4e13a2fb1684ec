"""The SWE domain: repository tasks in the SWE-bench schema (`instances`), a seeded toy generator (`generator`),
sandboxes and the reward (`sandbox`), the teacher's value-estimation and process-reward prompts (`prompts`), and a
scripted hindsight-value estimator behind the engine / OpenAI interface (`values`)."""
