"""The JAX sampler's engines of the test run: one `JaxEngine` per family on the learner's
published draws (`vllm_served.published_families`), after the engine conformance scenario
(tests/support/engine_scenario.py), shared by tests/test_engine_conformance.py and the sampler
tests (a session fixture, registered in conftest.py; no vLLM involved).

The sampler is sized to exercise its machinery on short sequences: pages of 4 positions (the
MiMo window of 5 needs a ring of one page; the 12-token prompts span three), 4 decode slots (a
request of 4 samples fills them; the next waits for a free one), 3 decode steps per call
(sequences join and leave mid-turn), prefill chunks of at most 16 tokens (a continuation past
that is prefilled in two), one sequence per prefill call (tests/test_paged_sampler.py runs
several: one compile less here).
"""
import pytest

from gagar_jax.rollout.engine import EngineOptions
from gagar_jax.sample.engine import make_engine
from gagar_jax.sample.sampler import SamplerConfig
from support.engine_scenario import run as run_scenario
from support.vllm_served import CONFIGS, GEN, PROMPT, PROMPT_B

MAX_LEN = 64
SAMPLER = SamplerConfig(slots=4, page=4, max_len=MAX_LEN, decode_steps=3, max_chunk=16,
                        max_prefill_rows=1)


@pytest.fixture(scope="session")
def jax_served(published_families):
    """{family: (engine serving step 2, the scenario's answers)}."""
    out = {}
    for family in CONFIGS:
        _, _, dirs, _ = published_families[family]
        engine = make_engine(dirs[2], EngineOptions(seed=0, max_model_len=MAX_LEN), SAMPLER)
        got = run_scenario(engine, {"step1": dirs[1], "step2": dirs[2], "prompt": PROMPT,
                                    "prompt_b": PROMPT_B, "gen": GEN})
        out[family] = (engine, got)
    return out
