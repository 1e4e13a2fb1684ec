"""The SWE domain: repository tasks in the SWE-bench schema (`instances`), a seeded toy generator (`generator`),
sandboxes and the reward (`sandbox`), the teacher's value-estimation and process-reward prompts (`prompts`), the
three harness conventions (`convention`; in process: `harness`; the bash and tool program: `tool_harness`, its
Rollouts: `tool_rollout`), the scripted teacher (`teacher`) and a scripted hindsight-value estimator behind the
engine / OpenAI interface (`values`)."""
