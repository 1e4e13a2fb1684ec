"""The software-engineering domain: the teacher's value-estimation and process-reward grading prompts."""
