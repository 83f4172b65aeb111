"""The miniature's world: a synthetic code-edit task, a groupwise grader, warm-start demos.

task.py    token layout, tasks, the multi-turn environment and the test runner
grader.py  rule-based groupwise grader: tiers, ranks, hack flags, feed records
demos.py   synthetic clean and sloppy demonstrations and the supervised warm start
"""
