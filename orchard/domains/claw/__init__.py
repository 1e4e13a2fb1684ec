"""The Claw domain (personal-assistant workflows): a mock assistant world run inside the sandbox (`world`), seeded
tasks with their checks (`tasks`), the ReAct tool convention and its in-process harness (`convention`, `harness`),
the text harness program and its Rollouts (`text_harness`, `text_rollout`), the scripted teacher (`teacher`) and
the tokenizer corpus (`corpus`). See docs/domains.md."""
