"""The automated research loop (experimental): studies that run, recover and report themselves.

    jetctl research studies/crash.yaml --parallel 3     # run (or resume) a study
    jetctl research status runs/research/crash          # its trials, live

A study (`jetctl.research.study`) names a base recipe, a hypothesis, a metric, a budget and
a search space over recipe fields. Each trial is a plain `jetctl up` of the modified recipe
in its own run directory (`jetctl.research.trial`), watched by a watchdog
(`jetctl.research.watchdog`): a crashed trial resumes with `jetctl up --resume`, a diverged,
collapsed or stalled one is stopped. Optuna picks the values and prunes (`jetctl.research.
runner`); its sqlite storage is the study's state, so a study resumes after its own crash.
`jetctl.research.report` writes the study's Markdown and HTML report.

An optional planner model (`jetctl.research.planner`) proposes trials within the space.
Budgets may be in cost from each trial's ledger (CPU seconds, reported USD), and the metric
a figure of a task's in-run eval (`metric: {task: T, eval: pass_at_1}`).
"""
