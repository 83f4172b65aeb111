"""gagar_jax: the learner side of Gagar (Groupwise Agentic Grading and Advantage Redistribution).

Data flows feed -> batch -> loss(advantage) -> train step -> checkpoint.
"""

__version__ = "0.1.0"
