"""The miniature's world: a synthetic code-edit task, a groupwise grader, warm-start demos.

task.py        token layout, tasks, the multi-turn environment and the test runner
grader.py      rule-based groupwise grader: tiers, ranks, hack flags, feed records
demos.py       synthetic clean and sloppy demonstrations and the supervised warm start
sampler.py     batched autoregressive sampling with a KV cache kept across turns
producer.py    the rollout producer: sample groups, grade them, write feed shards
arms.py        the three advantage modes and the control ablation
experiment.py  the in-process closed loop: sample -> grade -> Feed -> train step
measure.py     per-step measurements: probe entropy, KL to the warm start, lengths
report.py      tables, plots and the pre-registered criteria of a sweep
tabular.py     round three's Design A: a tabular policy trained with the library's advantage
               and loss (every arm x sampler x seed in one vmapped program)
tabular_report.py  Design A's CSV, tables, criteria and plots
"""
