"""Executions plane (docs/design.md §4–5): the black-box harness runner (`runner`), the evaluator with
partial-progress rewards and retries (`evaluator`), tasks / datasets / groups (`tasks`), and
their configuration (`config`)."""
